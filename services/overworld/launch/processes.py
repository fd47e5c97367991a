"""The processes below a service, read from /proc: once a service dies its orphans (a killed trainer's
Ray workers, a worker's env processes) are found only through what was noted while it lived."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first, start time at index 19),
    or None when there is no such process."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def descendants(pid: int) -> list[tuple[int, str]]:
    """Every process below `pid` as (pid, start time); the start time tells a reused pid from the
    process we saw."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        fields = proc_stat(int(entry.name)) if entry.name.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append((int(entry.name), fields[19]))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child[0])
    return out


def kill_if_same(pid: int, started: str) -> None:
    """SIGKILL `pid` if it is still the process that started at `started`."""
    fields = proc_stat(pid)
    if fields is not None and fields[19] == started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
