"""Writing into the device tool's $OUT, whose files come back even when the command is killed.

The tool brings back at most 8 files of at most 16 MiB each, named in letters, digits, '.', '_' and '-'
alone. The check writes six: probe.json, one JSON per step and check.log. A JSON file is replaced whole
(written beside it, then renamed), so a command killed mid-write leaves the last complete version.
Standard library only (it runs before anything is installed on the box).
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
LOG_NAME = "check.log"
LOG_LIMIT = 8 * 2**20  # the log stops growing here, far below the tool's 16 MiB
NAME = re.compile(r"[A-Za-z0-9._-]+")


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` whole with `data`."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Outbox:
    """$OUT: the step files and the log, which every line of every step's output goes to as it comes."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = directory / LOG_NAME
        self._log_bytes = 0
        self._lock = threading.Lock()

    def path(self, name: str) -> Path:
        if not NAME.fullmatch(name):
            raise ValueError(f"{name!r}: the device tool brings back only plain names")
        return self.dir / name

    def write(self, name: str, data: dict[str, Any]) -> None:
        write_json(self.path(name), data)

    def log(self, line: str) -> None:
        """Append one line to check.log (and nothing once it holds LOG_LIMIT bytes)."""
        data = line.rstrip("\n").encode(errors="replace") + b"\n"
        with self._lock:
            if self._log_bytes + len(data) > LOG_LIMIT:
                return
            with self.log_path.open("ab") as f:
                f.write(data)
            self._log_bytes += len(data)
