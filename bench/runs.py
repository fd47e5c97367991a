"""Helpers for benchmarks that train through `overworld run` and read its summary and curve."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rehearsal.oci_images import ImageStore

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def overworld_run(config: str, workdir: Path, *args: str, timeout: float = 7200) -> dict[str, Any]:
    """Train; return the summary with the learning curve (progress.jsonl) under "curve"."""
    workdir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "overworld.cli", "run", str(ROOT / config), "--workdir", str(workdir),
           "--summary", str(workdir / "summary.json"), *args]
    print("$", " ".join(cmd), flush=True)
    with open(workdir / "stdout.log", "a") as out:
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return read_run(workdir)


def read_run(workdir: Path) -> dict[str, Any]:
    """The summary of the run in `workdir` with its learning curve. A run resumed with --resume appends
    to progress.jsonl and counts wall time from its own start: the curve's wall time adds them up."""
    summary_path = workdir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "no summary"}
    curve_path = workdir / "progress.jsonl"
    curve = [json.loads(line) for line in curve_path.read_text().splitlines()] if curve_path.exists() else []
    before, last = 0.0, 0.0
    for point in curve:
        if point["wall_seconds"] < last:
            before += last
        last = point["wall_seconds"]
        point["wall_seconds"] = round(last + before, 2)
    summary["curve"] = curve
    summary["wall_seconds_all_segments"] = curve[-1]["wall_seconds"] if curve else None
    return summary


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip()


# A run is marked loaded when the machine's 1-minute load average exceeds this at its start or end (2 cores:
# two runnable processes per core), or when the bench itself loads it (busy processes beside the run).
LOADED_ABOVE = 4.0

# The tree as it was when this benchmark started: a result measured for an hour names the code it ran,
# not the commit someone made while it ran.
STARTED = {"commit": _git("rev-parse", "HEAD"),
           "tree_modified": bool(_git("status", "--porcelain", "--untracked-files=no")),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_average_at_start": round(os.getloadavg()[0], 2)}


def provenance() -> dict[str, Any]:
    """What a result was measured on: the commit and whether the tree had changes, both as they were
    when the benchmark started, the start and finish dates, the machine and the command, so that a
    figure can be traced to the code and hardware that made it."""

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    memory = next((int(line.split()[1]) // 1024**2 for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), 0) if Path("/proc/meminfo").exists() else 0
    end = round(os.getloadavg()[0], 2)
    return {**STARTED, "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_average_at_end": end,
            "loaded": max(STARTED["load_average_at_start"], end) > LOADED_ABOVE,
            "machine": {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": memory, "kernel": os.uname().release},
            "command": " ".join(["python", *sys.argv])}


def _tree() -> dict[str, Any]:
    return {"commit": _git("rev-parse", "HEAD"),
            # a bench's own results (written as it goes) are not a change to what it measures
            "tree_modified": bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results"))}


def wait_for_quiet(limit: float = 120.0) -> float:
    """Wait (at most `limit` seconds) until the 1-minute load average is at most LOADED_ABOVE: a run after a
    fleet of twelve would otherwise start on the previous run's load. Returns the seconds waited."""
    started = time.monotonic()
    while os.getloadavg()[0] > LOADED_ABOVE and time.monotonic() - started < limit:
        time.sleep(2.0)
    return round(time.monotonic() - started, 1)


class RunRecord:
    """What one run of a benchmark ran on, written as it runs: the commit and whether the tree had changes,
    its start and end, and the machine's load at both (never filled in afterwards).

        with RunRecord(busy_processes=2) as record:
            ...                               # the run
        result = {**record.fields, ...}
    """

    def __init__(self, busy_processes: int = 0) -> None:
        self.busy_processes = busy_processes
        self.fields: dict[str, Any] = {}

    def __enter__(self) -> RunRecord:
        self.fields = {**_tree(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                       "load_average_at_start": round(os.getloadavg()[0], 2), "busy_processes": self.busy_processes}
        return self

    def __exit__(self, *_: object) -> None:
        end = round(os.getloadavg()[0], 2)
        start = self.fields["load_average_at_start"]
        self.fields.update(finished=time.strftime("%Y-%m-%dT%H:%M:%S"), load_average_at_end=end,
                           loaded=bool(self.busy_processes) or max(start, end) > LOADED_ABOVE)


def write(name: str, result: dict[str, Any], directory: Path = RESULTS) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    result = {"benchmark": name, **provenance(), "cpus": os.cpu_count(), **result}
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return path


def first_reaching(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    for point in curve:
        value = point.get("mean_return_last_100")
        if value is not None and value >= target and point.get("episodes", 0) >= 100:
            return point
    return None


def ready_to_rehearse(name: str, build_log: Path, target: str = "rehearsal-images") -> ImageStore | None:
    """A rehearsal bench's start: root (it builds network namespaces; None, said, without), SIGTERM (a CI
    timeout, kill) unwinding like Ctrl-C, so that its pods and namespaces are removed, and its images
    built (`make TARGET`, cached layers reused; the build's output in `build_log`). The caller closes
    the store it gets."""
    from rehearsal.oci_images import ImageStore, build

    if os.geteuid() != 0:
        print(f"{name} needs root: the rehearsal builds network namespaces", file=sys.stderr)
        return None
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    print(f"[{time.strftime('%H:%M:%S')}] building the images (make {target}; cached layers are reused)", flush=True)
    build(build_log, target=target)
    return ImageStore.here()
