"""Where a Crafter cow run's env steps go: `overworld run examples/crafter_cow.yaml` for a fixed budget,
with one worker and with two, the weights by relay and by star, one run each after the other.

Per run: the share of env steps trained on (`env_steps_used`, the goal: at least 97%), where the others
went (`env_steps_not_trained`: stale, left in the buffer at the stop, not sent), the fleet's idle share,
env steps/s, the policy lag, and the run's commit, start and load (bench/runs.py RunRecord).

    python -m bench.bench_used        -> bench/results/used_crafter_cow.json

Knobs (environment): BENCH_USED_STEPS (100000), BENCH_USED_WORKERS (1,2), BENCH_USED_MODES (relay,star).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.runs import RunRecord, overworld_run, wait_for_quiet, write

CONFIG = "examples/crafter_cow.yaml"
GOAL = 0.97


def one_run(workers: int, mode: str, steps: int, workdir: Path) -> dict[str, Any]:
    env = {"OVERWORLD_REGISTRY_RELAY_FANOUT": "0"} if mode == "star" else {}
    waited = wait_for_quiet()
    before = os.environ.copy()
    os.environ.pop("OVERWORLD_REGISTRY_RELAY_FANOUT", None)
    os.environ.update(env)
    try:
        with RunRecord() as record:
            run = overworld_run(CONFIG, workdir, "--set", f"rollout_config.num_rollout_workers={workers}",
                                "--max-env-steps", str(steps), timeout=3600)
    finally:
        os.environ.clear()
        os.environ.update(before)
    lag = run.get("policy_lag") or {}
    return {"workers": workers, "mode": mode, **record.fields, "waited_for_quiet_seconds": waited,
            "status": run.get("status"), "env_steps": run.get("env_steps"), "wall_seconds": run.get("wall_seconds"),
            "env_steps_per_second": run.get("env_steps_per_second"), "idle_share": run.get("idle_share"),
            "env_steps_used": run.get("env_steps_used"), "env_steps_not_trained": run.get("env_steps_not_trained"),
            "policy_lag_p50": lag.get("p50"), "policy_lag_p95": lag.get("p95"),
            "mean_return_last_100": run.get("mean_return_last_100")}


def main() -> None:
    steps = int(os.environ.get("BENCH_USED_STEPS", 100_000))
    workers = [int(w) for w in os.environ.get("BENCH_USED_WORKERS", "1,2").split(",")]
    modes = os.environ.get("BENCH_USED_MODES", "relay,star").split(",")
    runs = []
    with tempfile.TemporaryDirectory(prefix="used-") as tmp:
        for n in workers:
            for mode in modes:
                run = one_run(n, mode, steps, Path(tmp) / f"{n}-{mode}")
                print(json.dumps(run), flush=True)
                runs.append(run)
    used = [r["env_steps_used"] for r in runs if r["env_steps_used"] is not None]
    write("used_crafter_cow", {"config": CONFIG, "budget_env_steps": steps, "goal": f">= {GOAL}",
                               "worst_used": min(used) if used else None,
                               "goal_met": len(used) == len(runs) and min(used) >= GOAL, "runs": runs})


if __name__ == "__main__":
    main()
