"""Learning at fleet size: CartPole through every service with 1, 4 and 12 rollout workers, weights by
relay and by star, several runs of each (run i of every configuration has seed i+1), every other run
with a busy process per core beside it (as a game keeps a worker's cores busy). A fleet is for learning,
and an env step is the dearest thing in the system: a run counts by what it learned per env step, and
by how many of its env steps the learner trained on.

Every run goes to a fixed budget of env steps (250,000) and records:
- the return at the end (the mean of the last 100 episodes when the budget ran out), and the env steps
  and wall seconds at which that mean first reached 450 (`overworld run --target-return 450 --keep-going`);
- the share of its env steps the learner trained on, and where the others went (stale, left in the
  buffer, under way when the run ended, ...: the summary's `env_steps_not_trained`);
- env steps/s, the fleet's idle share (env-slot seconds waiting for room in the replay buffer over all
  env-slot seconds), the policy lag of the steps trained on (median, 95th percentile), the push time;
- its commit, whether the tree was modified, its start and end, and the load average at both, written
  as it runs (bench/runs.py RunRecord); a run over load 4 is marked loaded (a fleet of twelve on two
  cores loads them by itself).

The A/B: the 12-worker relay runs again with reservations off (`replay_buffer_config.reservations:
false`, the same seeds), beside the same runs with them on.

    python -m bench.bench_fleet_learning [--runs-file F]   -> bench/results/fleet_learning.json

Each finished run is appended to the runs file (one JSON line) and a run already there is not run again:
an interrupted bench (over an hour of the machine) goes on where it stopped.

Knobs (environment): BENCH_FLEET_WORKERS (1,4,12), BENCH_FLEET_MODES (relay,star), BENCH_FLEET_RUNS (5),
BENCH_FLEET_STEPS (250000), BENCH_FLEET_BUSY (alternate: every other run loaded; none; all),
BENCH_FLEET_AB (1: the reservations-off runs; 0: none).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.runs import RunRecord, overworld_run, wait_for_quiet, write

TARGET = 450.0


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def one_run(workers: int, mode: str, index: int, busy: int, budget: int, reservations: bool,
            workdir: Path) -> dict[str, Any]:
    if mode == "star":
        os.environ["OVERWORLD_REGISTRY_RELAY_FANOUT"] = "0"
    else:
        os.environ.pop("OVERWORLD_REGISTRY_RELAY_FANOUT", None)
    waited = 0.0 if busy else wait_for_quiet()
    with RunRecord(busy) as record:
        load = busy_processes(busy)
        try:
            run = overworld_run(
                "examples/cartpole.yaml", workdir, "--set", f"seed={index + 1}",
                "--set", f"rollout_config.num_rollout_workers={workers}",
                "--set", f"rollout_config.replay_buffer_config.reservations={str(reservations).lower()}",
                "--max-env-steps", str(budget), "--target-return", str(TARGET), "--keep-going", timeout=3600)
        finally:
            for proc in load:
                proc.kill()
                proc.wait()
    curve = run.get("curve", [])
    pushes = sorted(p["registry/push_seconds"] for p in curve if p.get("registry/push_seconds"))
    buffer = run.get("replay_buffer", {})
    drops = buffer.get("dropped_chunks", {})
    reached = run.get("steps_to_target")
    lag = run.get("policy_lag") or {}
    return {
        "workers": workers, "mode": mode, "index": index, "seed": index + 1, "reservations": reservations,
        "budget_env_steps": budget, **record.fields, "waited_for_quiet_seconds": waited,
        "status": run.get("status"), "env_steps": run.get("env_steps"), "wall_seconds": run.get("wall_seconds"),
        "env_steps_per_second": run.get("env_steps_per_second"),
        "return_at_end": run.get("mean_return_last_100"),
        "env_steps_to_target": reached,
        "wall_seconds_to_target": run.get("wall_seconds_to_target"),
        "iterations": run.get("iterations"), "env_steps_used": run.get("env_steps_used"),
        "env_steps_not_trained": run.get("env_steps_not_trained"),
        "idle_share": run.get("idle_share"), "policy_lag_p50": lag.get("p50"), "policy_lag_p95": lag.get("p95"),
        "stale_chunks": drops.get("stale", 0) + drops.get("stale_on_arrival", 0),
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
        "env_steps_per_second": spread([r["env_steps_per_second"] for r in runs]),
        "idle_share": spread([r["idle_share"] for r in runs], lower_is_better=True),
        "policy_lag_p50": spread([r["policy_lag_p50"] for r in runs], lower_is_better=True),
        "policy_lag_p95": spread([r["policy_lag_p95"] for r in runs], lower_is_better=True),
        "push_seconds_max": spread([r["push_seconds_max"] for r in runs], lower_is_better=True),
        "loaded_runs": sum(bool(r["loaded"]) for r in runs),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def comparisons(configs: dict[str, dict[str, Any]], largest: int) -> dict[str, Any]:
    """The figures the issue asks of a fleet: its median env steps to 450 over one worker's, by relay and by
    star; and the A/B of reservations at the largest fleet."""
    out: dict[str, Any] = {}
    for mode in ("relay", "star"):
        one, many = configs.get(f"1-{mode}"), configs.get(f"{largest}-{mode}")
        if one and many:
            out[f"{largest}_over_1_{mode}_env_steps_to_target"] = ratio(many["env_steps_to_target"]["median"],
                                                                         one["env_steps_to_target"]["median"])
    on, off = configs.get(f"{largest}-relay"), configs.get(f"{largest}-relay-reservations-off")
    if on and off:
        out["reservations_on_over_off_env_steps_per_second"] = ratio(on["env_steps_per_second"]["median"],
                                                                      off["env_steps_per_second"]["median"])
    return out


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
    ab = os.environ.get("BENCH_FLEET_AB", "1") == "1"
    cores = os.cpu_count() or 1
    plan = [(w, m, True) for w in sizes for m in modes] + ([(max(sizes), "relay", False)] if ab else [])
    done = {(r["workers"], r["mode"], r["reservations"], r["index"], r["busy_processes"], r["budget_env_steps"]): r
            for r in done_runs(args.runs_file) if "reservations" in r}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fleet-learning-") as tmp:
        for workers, mode, reservations in plan:
            for i in range(repeats):
                busy = {"none": 0, "all": cores}.get(loading, cores if i % 2 else 0)
                run = done.get((workers, mode, reservations, i, busy, budget))
                if run is None:
                    name = f"w{workers}-{mode}-{'on' if reservations else 'off'}-{i}"
                    run = one_run(workers, mode, i, busy, budget, reservations, Path(tmp) / name)
                    if args.runs_file:
                        with args.runs_file.open("a") as f:
                            f.write(json.dumps(run) + "\n")
                print(json.dumps(run), flush=True)
                runs.append(run)
    configs = {f"{w}-{m}" + ("" if on else "-reservations-off"):
               summarise([r for r in runs if r["workers"] == w and r["mode"] == m and r["reservations"] == on])
               for w, m, on in plan}
    write("fleet_learning", {"target_return": TARGET, "budget_env_steps": budget,
                             "config": "examples/cartpole.yaml", "configs": configs,
                             "comparisons": comparisons(configs, max(sizes)),
                             "commits": sorted({r["commit"] for r in runs}), "runs": runs})


if __name__ == "__main__":
    main()
