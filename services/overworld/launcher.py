"""`overworld.launcher`: the names other code imports (overworld.online, the CLI, tests). `overworld run`
itself lives in overworld.launch, one module per concern (see its __init__). Each name is imported when
first asked for: reading /proc (`_stat`) does not pull in the run loop's gRPC clients."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Launcher": ("overworld.launch.supervisor", "Supervisor"),
    "RunSecurity": ("overworld.launch.credentials", "RunSecurity"),
    "_stat": ("overworld.launch.processes", "proc_stat"),
    "descendants": ("overworld.launch.processes", "descendants"),
    "kill_if_same": ("overworld.launch.processes", "kill_if_same"),
    "run": ("overworld.launch.run", "run"),
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    return getattr(importlib.import_module(module), attribute)
