"""Overworld: online reinforcement learning as gRPC services."""

__version__ = "0.1.0"
