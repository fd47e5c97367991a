"""Resolve `module:attribute` and `path/to/file.py:attribute` references."""

from __future__ import annotations

import importlib
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


def call_generator(fn: Any, user_kwargs: dict[str, Any], **context: Any) -> Any:
    """Call a generator with the user's kwargs (all of them, so a typo is an error) plus whichever
    context arguments (spaces, seed) it declares. MineStudio generators take none of either."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in user_kwargs if k not in params and not takes_any]
    if unknown:
        raise ValueError(f"{fn.__module__}.{fn.__qualname__} does not accept {', '.join(sorted(unknown))}")
    accepted = {k: v for k, v in context.items() if takes_any or k in params}
    return fn(**accepted, **user_kwargs)
