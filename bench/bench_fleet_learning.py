"""Learning at fleet size: CartPole through every service with 1, 4 and 12 rollout workers, weights by
relay and by star, several runs of each, every other run with a busy process per core beside it (as a
game keeps a worker's cores busy). What a fleet is for is learning: a run counts here by what it
learned within a budget of env steps, and how steadily.

Per run: env steps and wall seconds to a 100-episode mean return of 450, the return where the run
ended (450 reached, or the budget of env steps), the share of the env steps the learner trained on,
chunks dropped as stale, and the push time (publish -> every worker acts with the version: the
registry counts a version delivered when each worker has swapped it in, not when the bytes arrived).
Per configuration: the median, the worst and the spread of each.

    python -m bench.bench_fleet_learning [--runs-file F]   -> bench/results/fleet_learning.json

Each finished run is appended to the runs file (one JSON line, with the commit it ran at and the load
average beside it) and a run already there is not run again: an interrupted bench (an hour of the
machine) goes on where it stopped.

Knobs (environment): BENCH_FLEET_WORKERS (1,4,12), BENCH_FLEET_MODES (relay,star), BENCH_FLEET_RUNS (5),
BENCH_FLEET_STEPS (250000), BENCH_FLEET_BUSY (alternate: every other run loaded; none; all).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.runs import STARTED, first_reaching, overworld_run, write

TARGET = 450.0


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def one_run(workers: int, mode: str, index: int, busy: int, budget: int, workdir: Path) -> dict[str, Any]:
    if mode == "star":
        os.environ["OVERWORLD_REGISTRY_RELAY_FANOUT"] = "0"
    else:
        os.environ.pop("OVERWORLD_REGISTRY_RELAY_FANOUT", None)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    load = busy_processes(busy)
    try:
        run = overworld_run("examples/cartpole.yaml", workdir, "--set", f"rollout_config.num_rollout_workers={workers}",
                            "--max-env-steps", str(budget), "--target-return", str(TARGET), timeout=1800)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    curve = run.get("curve", [])
    reached = first_reaching(curve, TARGET)
    pushes = sorted(p["registry/push_seconds"] for p in curve if p.get("registry/push_seconds"))
    buffer = run.get("replay_buffer", {})
    return {
        "workers": workers, "mode": mode, "index": index, "busy_processes": busy, "budget_env_steps": budget,
        "commit": STARTED["commit"], "started": started, "load_average_after": round(os.getloadavg()[0], 2),
        "status": run.get("status"),
        "env_steps": run.get("env_steps"), "wall_seconds": run.get("wall_seconds"),
        "return_at_end": run.get("mean_return_last_100"),
        "env_steps_to_target": reached["env_steps"] if reached else None,
        "wall_seconds_to_target": reached["wall_seconds"] if reached else None,
        "iterations": run.get("iterations"), "env_steps_used": run.get("env_steps_used"),
        "stale_chunks": buffer.get("dropped_chunks", {}).get("stale", 0),
        "inserted_fragments": buffer.get("inserted_fragments"),
        "push_seconds_median": statistics.median(pushes) if pushes else None,
        "push_seconds_max": pushes[-1] if pushes else None,
    }


def spread(values: list[float | None], lower_is_better: bool = False) -> dict[str, float | None]:
    """Median, worst, best and spread of the known values; `missing`: runs without one."""
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "worst": None, "best": None, "spread": None, "missing": len(values)}
    worst, best = (max(known), min(known)) if lower_is_better else (min(known), max(known))
    return {"median": statistics.median(known), "worst": worst, "best": best, "spread": max(known) - min(known),
            "missing": len(values) - len(known)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "runs": len(runs),
        "reached_target": sum(r["env_steps_to_target"] is not None for r in runs),
        "return_at_end": spread([r["return_at_end"] for r in runs]),
        "env_steps_to_target": spread([r["env_steps_to_target"] for r in runs], lower_is_better=True),
        "wall_seconds_to_target": spread([r["wall_seconds_to_target"] for r in runs], lower_is_better=True),
        "env_steps_used": spread([r["env_steps_used"] for r in runs]),
        "push_seconds_max": spread([r["push_seconds_max"] for r in runs], lower_is_better=True),
    }


def done_runs(runs_file: Path | None) -> list[dict[str, Any]]:
    if runs_file is None or not runs_file.exists():
        return []
    return [json.loads(line) for line in runs_file.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs-file", type=Path, help="finished runs, one JSON line each; runs found here are kept")
    args = p.parse_args(argv)
    sizes = [int(x) for x in os.environ.get("BENCH_FLEET_WORKERS", "1,4,12").split(",")]
    modes = os.environ.get("BENCH_FLEET_MODES", "relay,star").split(",")
    repeats = int(os.environ.get("BENCH_FLEET_RUNS", 5))
    budget = int(os.environ.get("BENCH_FLEET_STEPS", 250_000))
    loading = os.environ.get("BENCH_FLEET_BUSY", "alternate")
    cores = os.cpu_count() or 1
    done = {(r["workers"], r["mode"], r["index"], r["busy_processes"], r["budget_env_steps"]): r
            for r in done_runs(args.runs_file)}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fleet-learning-") as tmp:
        for workers in sizes:
            for i in range(repeats):
                for mode in modes:  # relay and star interleaved: both see the same hour of the machine
                    busy = {"none": 0, "all": cores}.get(loading, cores if i % 2 else 0)
                    run = done.get((workers, mode, i, busy, budget))
                    if run is None:
                        run = one_run(workers, mode, i, busy, budget, Path(tmp) / f"w{workers}-{mode}-{i}")
                        if args.runs_file:
                            with args.runs_file.open("a") as f:
                                f.write(json.dumps(run) + "\n")
                    print(run, flush=True)
                    runs.append(run)
    configs = {f"{w}-{m}": summarise([r for r in runs if r["workers"] == w and r["mode"] == m])
               for w in sizes for m in modes}
    write("fleet_learning", {"target_return": TARGET, "budget_env_steps": budget,
                             "config": "examples/cartpole.yaml", "configs": configs,
                             "commits": sorted({r["commit"] for r in runs}), "runs": runs})


if __name__ == "__main__":
    main()
