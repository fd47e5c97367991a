"""How much of what a Crafter fleet steps the learner trains on: examples/crafter_cow.yaml (16 envs a
worker, pixels, a CNN) with 1 and 4 rollout workers, weights by relay and by star, each to a budget of
env steps. Per run: the share of env steps trained on and where the rest went (the summary's
`env_steps_not_trained`), the fleet's idle share, the policy lag of what was trained on, env steps/s,
and the run's commit, start and load (bench/runs.py RunRecord).

    python -m bench.bench_crafter_used       -> bench/results/crafter_used.json

Knobs (environment): BENCH_CRAFTER_WORKERS (1,4), BENCH_CRAFTER_MODES (relay,star), BENCH_CRAFTER_STEPS (100000).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from bench.runs import RunRecord, overworld_run, wait_for_quiet, write

CONFIG = "examples/crafter_cow.yaml"


def one_run(workers: int, mode: str, steps: int, workdir: Path) -> dict[str, Any]:
    env_before = os.environ.get("OVERWORLD_REGISTRY_RELAY_FANOUT")
    if mode == "star":
        os.environ["OVERWORLD_REGISTRY_RELAY_FANOUT"] = "0"
    waited = wait_for_quiet()
    try:
        with RunRecord() as record:
            run = overworld_run(CONFIG, workdir, "--set", f"rollout_config.num_rollout_workers={workers}",
                                "--max-env-steps", str(steps), timeout=3600)
    finally:
        if mode == "star":
            if env_before is None:
                os.environ.pop("OVERWORLD_REGISTRY_RELAY_FANOUT", None)
            else:
                os.environ["OVERWORLD_REGISTRY_RELAY_FANOUT"] = env_before
    lag = run.get("policy_lag") or {}
    return {"workers": workers, "mode": mode, **record.fields, "waited_for_quiet_seconds": waited,
            "status": run.get("status"), "env_steps": run.get("env_steps"), "wall_seconds": run.get("wall_seconds"),
            "env_steps_per_second": run.get("env_steps_per_second"),
            "mean_return_last_100": run.get("mean_return_last_100"), "env_steps_used": run.get("env_steps_used"),
            "env_steps_not_trained": run.get("env_steps_not_trained"), "idle_share": run.get("idle_share"),
            "policy_lag_p50": lag.get("p50"), "policy_lag_p95": lag.get("p95")}


def main() -> None:
    sizes = [int(x) for x in os.environ.get("BENCH_CRAFTER_WORKERS", "1,4").split(",")]
    modes = os.environ.get("BENCH_CRAFTER_MODES", "relay,star").split(",")
    steps = int(os.environ.get("BENCH_CRAFTER_STEPS", 100_000))
    runs = []
    with tempfile.TemporaryDirectory(prefix="crafter-used-") as tmp:
        for workers in sizes:
            for mode in modes if workers > 1 else modes[:1]:  # one worker: relay and star are the same push
                run = one_run(workers, mode, steps, Path(tmp) / f"w{workers}-{mode}")
                print(json.dumps(run), flush=True)
                runs.append(run)
    used = [r["env_steps_used"] for r in runs if r["env_steps_used"] is not None]
    write("crafter_used", {"config": CONFIG, "budget_env_steps": steps, "worst_env_steps_used": min(used, default=None),
                           "target": ">= 0.97", "target_met": bool(used) and min(used) >= 0.97, "runs": runs})


if __name__ == "__main__":
    main()
