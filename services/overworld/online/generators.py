"""Generators (and trainer classes) reach other processes and containers by import path.

A function defined with `def` at module level is found again by its module and name
(`package.module:function`), or, when it lives in the script being run (`__main__`) or in a file that
is not importable by name, by its file (`/path/to/file.py:function`). A lambda, a closure or a
method has no such address: that is an error that says what to do.
"""

from __future__ import annotations

import importlib.machinery
import inspect
import sys
from pathlib import Path
from typing import Any


class GeneratorError(TypeError):
    """A generator that other processes cannot find by import path."""


def _file_of(obj: Any) -> Path | None:
    try:
        source = inspect.getsourcefile(obj)
    except TypeError:
        return None
    return Path(source).resolve() if source else None


def _importable(module: str) -> bool:
    """True when a fresh interpreter finds `module` on the path the services get (not the script's own
    directory, which only this interpreter has on sys.path)."""
    top = module.split(".")[0]
    if top == "__main__":
        return False
    try:  # search sys.path, as a fresh interpreter would; sys.modules may hold files loaded by path
        spec = importlib.machinery.PathFinder.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return top in sys.builtin_module_names
    if spec.origin is None:  # a namespace package
        return True
    script_dir = Path(sys.argv[0]).resolve().parent if sys.argv and sys.argv[0] else None
    return script_dir is None or script_dir not in Path(spec.origin).resolve().parents


def generator_ref(obj: Any, what: str) -> str:
    """The import path of `obj` (a function or class), or a GeneratorError saying why there is none."""
    if isinstance(obj, str):
        if ":" not in obj:
            raise GeneratorError(f"{what}: {obj!r} is not 'module:function' or 'file.py:function'")
        return obj
    name = getattr(obj, "__qualname__", None)
    if not callable(obj) or name is None:
        raise GeneratorError(f"{what} must be a function defined with `def` at module level, got {obj!r}")
    why = ("a lambda" if name.endswith("<lambda>") else
           "defined inside another function" if "<locals>" in name else
           "a method or nested definition" if "." in name else "")
    module_name = getattr(obj, "__module__", None)
    module = sys.modules.get(module_name or "")
    if not why and getattr(module, name, None) is not obj:
        why = f"not reachable as {module_name}.{name}"
    if why:
        raise GeneratorError(
            f"{what} ({name}) is {why}: Overworld runs it in other processes and containers, which find it by "
            f"its file and name. Define it with `def {what}():` at the top level of a .py file (imports "
            f"inside it), or pass its import path as a string ('package.module:{what}').")
    if module_name and _importable(module_name):
        return f"{module_name}:{name}"
    path = _file_of(obj)
    if path is None:
        raise GeneratorError(f"{what} ({name}) has no source file; define it in a .py file")
    return f"{path}:{name}"
