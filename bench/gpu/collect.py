"""What the GPU call brought back, made into the results, by one command here:

    python -m bench.gpu.collect FILES_DIR            (the folder the device tool put $OUT's files in)

writes bench/results/gpu.json (each step's figures with the device, driver and torch that measured them,
the probe, provenance: the commit whose code ran, the box, the command) and then bench/report.py's
REPORT.md and the README's rows. A step the command did not finish is kept as it was left ("cut off" when
the command ended during it, "not reached" when it never began). From the Crafter step's throughput: how
many such calls the full Crafter benchmark (3 seeds x 1M env steps) would need.
Results of the stand-in box go only where --results says, never to bench/results.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.gpu.digest import commit_digest
from bench.gpu.outbox import read_json
from bench.gpu.plan import BOX, ROOT, STAND_IN, STEPS, documented_call

RESULTS = ROOT / "bench" / "results"
FULL_BENCHMARK_SEEDS = 3
FULL_BENCHMARK_ENV_STEPS = 1_000_000  # per seed


def step_record(name: str, found: dict[str, Any] | None) -> dict[str, Any]:
    if found is None:
        return {"step": name, "status": "not reached"}
    if found.get("status") == "running":  # the command ended (or was killed) during the step
        return {**found, "status": "cut off"}
    return found


def full_benchmark_calls(probe: dict[str, Any], crafter: dict[str, Any]) -> dict[str, Any]:
    """Calls of this kind that 3 seeds x 1M env steps would take at the measured throughput, if each call
    gave Crafter all the time that the probe and Crafter's start and stop leave of the budget."""
    rate = crafter.get("env_steps_per_second")
    total = FULL_BENCHMARK_SEEDS * FULL_BENCHMARK_ENV_STEPS
    if not rate:
        return {"env_steps": total, "calls": None, "why": "the call measured no Crafter throughput"}
    plan = STAND_IN if probe.get("stand_in") else BOX
    budget = probe.get("budget_seconds") or plan.budget
    seconds = budget - plan.end_margin - plan.crafter_stop - (probe.get("elapsed") or 0) - (crafter.get("startup_seconds") or 0)
    per_call = rate * seconds
    return {"env_steps": total, "seeds": FULL_BENCHMARK_SEEDS, "env_steps_per_second": rate,
            "crafter_seconds_per_call": round(seconds, 1), "env_steps_per_call": round(per_call),
            "calls": math.ceil(total / per_call) if per_call > 0 else None,
            "assumes": "each call runs only Crafter, resumes the previous call's checkpoint (carried in) and "
                       "brings its own back (~32 MB: over $OUT's 16 MiB a file, so in parts); a call holds "
                       "the box for about 11 of a lease's 15 minutes"}


def provenance(probe: dict[str, Any]) -> dict[str, Any]:
    host = probe.get("host") or {}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    started = probe.get("started_unix")
    return {"commit": commit, "tree_modified": host.get("code_digest") != commit_digest(ROOT, commit),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)) if started else None,
            "machine": {k: host.get(k) for k in ("cpu", "cpus", "memory_gib", "kernel", "gpu", "gpu_memory", "driver")},
            "command": probe.get("command")}


def gpu_result(files: Path) -> dict[str, Any]:
    probe = read_json(files / "probe.json")
    if probe is None:
        raise SystemExit(f"{files}: no probe.json: not the files of a GPU call")
    steps = {name: step_record(name, read_json(files / f"{name}.json")) for name in STEPS}
    steps["crafter"]["full_benchmark"] = full_benchmark_calls(probe, steps["crafter"])
    return {"benchmark": "gpu", **provenance(probe), "stand_in": bool(probe.get("stand_in")),
            "call": documented_call(), "probe": probe, **steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", type=Path, help="the call's files ($OUT as it came back)")
    p.add_argument("--results", type=Path, default=RESULTS, help="where gpu.json goes (bench/results)")
    args = p.parse_args(argv)
    result = gpu_result(args.files)
    into_results = args.results.resolve() == RESULTS.resolve()
    if result["stand_in"] and into_results:
        print("these are the stand-in box's files: give --results another folder", file=sys.stderr)
        return 2
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "gpu.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    from bench import report

    for row in report.headline_rows("gpu", result):
        print(row)
    if into_results:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints the whole report
            report.main()
        print(f"wrote {report.RESULTS / 'REPORT.md'} and README.md's rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
