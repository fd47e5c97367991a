"""The restart policy of `overworld run`, a Deployment's on one machine: any service that exits is
started again, on the same address. The first restart after a stable run is immediate (the run's
recovery time is the service's start time); a service that keeps crashing waits longer each time
(crash-loop backoff: 1, 2, 4 ... BACKOFF_CAP seconds), and one that crashed `max_restarts` times in a
row, each time within STABLE_SECONDS of its start, ends the run. A service that ran STABLE_SECONDS
starts the count again, so a run of days survives a crash now and then.

`services.json` in the run's workdir says where every service is (address, pid, log) and how often it
was restarted: `overworld status --workdir DIR` prints it, tests and benchmarks find the pids there.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_RESTARTS = 5  # in a row, per service
STABLE_SECONDS = 60.0
BACKOFF_CAP = 30.0
SERVICES_FILE = "services.json"


@dataclass
class Restarts:
    total: int = 0
    in_a_row: int = 0
    last_exit_code: int | None = None


class RestartPolicy:
    def __init__(self, max_restarts: int = MAX_RESTARTS, stable_seconds: float = STABLE_SECONDS,
                 backoff_cap: float = BACKOFF_CAP) -> None:
        self.max_restarts = max_restarts
        self.stable_seconds = stable_seconds
        self.backoff_cap = backoff_cap
        self.services: dict[str, Restarts] = {}

    def on_exit(self, name: str, code: int, ran_seconds: float) -> float | None:
        """A service exited after running `ran_seconds`: seconds to wait before starting it again, or
        None when it crashed too often in a row."""
        r = self.services.setdefault(name, Restarts())
        r.last_exit_code = code
        if ran_seconds >= self.stable_seconds:
            r.in_a_row = 0
        if r.in_a_row >= self.max_restarts:
            return None
        delay = min(self.backoff_cap, 2.0 ** (r.in_a_row - 1)) if r.in_a_row else 0.0
        r.in_a_row += 1
        return delay

    def restarted(self, name: str) -> Restarts:
        r = self.services.setdefault(name, Restarts())
        r.total += 1
        return r

    def totals(self) -> dict[str, int]:
        """Restarts per service (services never restarted left out)."""
        return {name: r.total for name, r in self.services.items() if r.total}


def write_services(workdir: Path, run_id: str, services: dict[str, dict[str, Any]], running: bool,
                   name: str = SERVICES_FILE) -> None:
    """`<workdir>/services.json` (or `name`: a second launcher of the same run, e.g. overworld.online's
    trainer, writes a file of its own), replaced atomically."""
    path = workdir / name
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"run_id": run_id, "launcher_pid": os.getpid(), "running": running,
                               "updated_unix": round(time.time(), 3), "services": services}, indent=1))
    os.replace(tmp, path)


def read_services(workdir: str | Path) -> dict[str, Any]:
    """Every launcher's services.json of a run, merged (FileNotFoundError if there is none)."""
    paths = sorted(Path(workdir).glob("services*.json"))
    if not paths:
        raise FileNotFoundError(Path(workdir) / SERVICES_FILE)
    merged: dict[str, Any] = {}
    for path in paths:
        found = json.loads(path.read_text())
        merged = {**found, "services": {**merged.get("services", {}), **found["services"]}}
    return merged
