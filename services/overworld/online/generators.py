"""Generators (and trainer classes) reach other processes by import path: core/imports.py."""

from overworld.core.imports import GeneratorError, generator_ref

__all__ = ["GeneratorError", "generator_ref"]
