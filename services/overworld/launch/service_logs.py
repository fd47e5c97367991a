"""What a service's log says when it ends: its last lines, or the one record it wrote before exiting
EXIT_CONFIG (core/service.py `log_refusal`: which generator, and the user's traceback)."""

from __future__ import annotations

import re
from pathlib import Path

from overworld.core.service import REFUSAL_RECORD

# A record's first line: `overworld run` gives its services the text log format (asctime first).
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
MAX_REFUSAL_LINES = 80


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def refusal(path: Path) -> str | None:
    """The last refusal record of the log at `path` (its first line through the traceback under it), or
    None when the service wrote none."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if REFUSAL_RECORD in line and RECORD_START.match(line)]
    if not starts:
        return None
    record = [lines[starts[-1]]]
    for line in lines[starts[-1] + 1:starts[-1] + MAX_REFUSAL_LINES]:
        if RECORD_START.match(line):
            break
        record.append(line)
    return "\n".join(record)
