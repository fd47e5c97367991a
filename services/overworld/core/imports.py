"""Resolve `module:attribute` and `path/to/file.py:attribute` references, and find them for an object.

Generators (and trainer classes) reach other processes and containers by import path. A function
defined with `def` at module level is found again by its module and name (`package.module:function`),
or, when it lives in the script being run (`__main__`) or in a file that is not importable by name, by
its file (`/path/to/file.py:function`). A lambda, a closure or a method has no such address: that is an
error that says what to do.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any


def import_object(ref: str) -> Any:
    if ":" not in ref:
        raise ValueError(f"{ref!r}: expected 'module:attribute' or 'file.py:attribute'")
    module_name, _, attr = ref.rpartition(":")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.exists():
            raise ValueError(f"{ref!r}: file {path} does not exist")
        name = f"_overworld_user_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, path)
            assert spec and spec.loader
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"{ref!r}: cannot import {module_name}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{ref!r}: {module_name} has no attribute {attr!r}") from None


def lazy_import(ref: str) -> Any:
    """A callable given by import path, imported on its first call (where it is needed)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return import_object(ref)(*args, **kwargs)

    call.__qualname__ = call.__name__ = ref.rsplit(":", 1)[-1]
    return call


def call_generator(fn: Any, user_kwargs: dict[str, Any], **context: Any) -> Any:
    """Call a generator with the user's kwargs (all of them, so a typo is an error) plus whichever
    context arguments (spaces, seed) it declares. MineStudio generators take none of either."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in user_kwargs if k not in params and not takes_any]
    if unknown:
        raise UserCodeError(_name_of(fn), f"does not accept {', '.join(sorted(unknown))}")
    accepted = {k: v for k, v in context.items() if takes_any or k in params}
    try:
        return fn(**accepted, **user_kwargs)
    except CODE_ERRORS as err:
        raise UserCodeError(_name_of(fn), f"raised {type(err).__name__}: {err}") from err
    # anything else (OSError, MemoryError, a RuntimeError such as CUDA's out of memory or a simulator that
    # did not start) may be the machine's state, which a restart can heal: it propagates as it is


# Errors of the code itself: a restart runs the same code into the same error.
CODE_ERRORS = (TypeError, ValueError, NameError, AttributeError, LookupError, ImportError, AssertionError,
               ArithmeticError, NotImplementedError, SyntaxError)


class UserCodeError(Exception):
    """A generator of the run's config (env_generator, policy_generator: the user's code, or Overworld's
    with the user's kwargs) raised an error of its code (CODE_ERRORS), or
    cannot take the config's kwargs. Starting the service again would fail the same way: it exits with
    EXIT_CONFIG (core/service.py), the user's traceback in `__cause__`."""

    def __init__(self, generator: str, problem: str) -> None:
        super().__init__(f"{generator} {problem}")
        self.generator = generator


def _name_of(fn: Any) -> str:
    """A generator as the user knows it: module and name, or the file it was loaded from by path."""
    module = getattr(fn, "__module__", "") or ""
    if module.startswith("_overworld_user_"):
        module = str(_file_of(fn) or module)
    return f"{module}:{getattr(fn, '__qualname__', repr(fn))}"


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
