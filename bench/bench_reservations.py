"""What reserving room costs a fleet the learner can keep up with: 12 rollout workers of 4 envs that
step at Minecraft's pace (20 steps/s each, rehearsal/scale_standin.py: the env sleeps, the CPU stays
free), through every service, reservations on and off (`replay_buffer_config.reservations`), the same
seeds, one after the other.

Here the fleet, not the learner, is the bottleneck: stepping more would not be thrown away, so
reservations must not make the fleet idle (the target: on loses at most 5% of the env steps/s of off).
Where the learner is the bottleneck (CPU-bound CartPole on two cores, bench/bench_fleet_learning.py's
A/B), idling is the point: reservations trade env steps/s that would be dropped for env steps trained on.

Per run: env steps/s, the fleet's idle share, the share of env steps trained on, the policy lag
(median, 95th percentile), and the run's commit, start and load (bench/runs.py RunRecord).

    python -m bench.bench_reservations        -> bench/results/reservations.json

The room in flight is two iterations' batches (`max_staleness` 3): at one batch the fleet waits while the
learner trains (it lost 16.8% of its env steps/s so, docs/replay_buffer.md "At Minecraft's pace").

Knobs (environment): BENCH_RES_WORKERS (12), BENCH_RES_SEEDS (1,2,3), BENCH_RES_STEPS (120000),
BENCH_RES_BAND (2: the room in flight, in iterations' batches; another value writes reservations_bandN.json).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench.runs import ROOT, RunRecord, overworld_run, wait_for_quiet, write

STANDIN = str(ROOT / "rehearsal" / "scale_standin.py")
FRAGMENT = 32
PER_ITERATION = 64  # fragments: 2,048 env steps an iteration


def config(workers: int, seed: int, reservations: bool, band: int = 2) -> dict[str, Any]:
    return {
        "task_name": "paced", "seed": seed,
        "env_generator": f"{STANDIN}:make_env", "policy_generator": f"{STANDIN}:make_policy",
        "policy_kwargs": {"weights_mb": 0.5},
        "rollout_config": {
            "num_rollout_workers": workers, "fragment_length": FRAGMENT, "to_send_queue_size": 8,
            "worker_config": {"num_envs": 4, "num_env_processes": 1, "device": "cpu", "env_backend": "inprocess"},
            "replay_buffer_config": {
                "max_chunks": 4 * PER_ITERATION, "max_reuse": 1, "max_staleness": band + 1, "fragments_per_chunk": 1,
                # room in flight: `band` iterations' batches (the CartPole examples: one)
                "samples_per_insert": 1.0, "samples_per_insert_error": band * PER_ITERATION - PER_ITERATION // 2,
                "min_size_to_sample": PER_ITERATION // 2, "reservations": reservations},
        },
        "train_config": {
            "num_workers": 0, "num_gpus_per_worker": 0, "num_iterations": 1_000_000, "learning_rate": 3e-4,
            "batch_size_per_gpu": PER_ITERATION // 8, "batches_per_iteration": 8, "gradient_accumulation": 1,
            "epochs_per_iteration": 1, "context_length": FRAGMENT, "discount": 0.95, "gae_lambda": 0.9,
            "ppo_clip": 0.2, "max_grad_norm": 0.5, "entropy_bonus_coef": 0.01, "prefetch_batches": 0,
            "save_interval": 1000, "keep_interval": 0},
        "logger_config": {"project": "overworld", "name": "reservations", "wandb": False},
    }


def one_run(workers: int, seed: int, reservations: bool, steps: int, workdir: Path, band: int) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config(workers, seed, reservations, band)))
    waited = wait_for_quiet()
    with RunRecord() as record:
        run = overworld_run(str(path), workdir / "run", "--max-env-steps", str(steps), timeout=1800)
    lag = run.get("policy_lag") or {}
    return {"workers": workers, "seed": seed, "reservations": reservations, **record.fields,
            "waited_for_quiet_seconds": waited, "status": run.get("status"), "env_steps": run.get("env_steps"),
            "wall_seconds": run.get("wall_seconds"), "env_steps_per_second": run.get("env_steps_per_second"),
            "idle_share": run.get("idle_share"), "env_steps_used": run.get("env_steps_used"),
            "env_steps_not_trained": run.get("env_steps_not_trained"),
            "policy_lag_p50": lag.get("p50"), "policy_lag_p95": lag.get("p95")}


def main() -> None:
    workers = int(os.environ.get("BENCH_RES_WORKERS", 12))
    seeds = [int(s) for s in os.environ.get("BENCH_RES_SEEDS", "1,2,3").split(",")]
    steps = int(os.environ.get("BENCH_RES_STEPS", 120_000))
    band = int(os.environ.get("BENCH_RES_BAND", 2))
    runs = []
    with tempfile.TemporaryDirectory(prefix="reservations-") as tmp:
        for seed in seeds:
            for on in (True, False):  # on and off back to back: both see the same minutes of the machine
                run = one_run(workers, seed, on, steps, Path(tmp) / f"{'on' if on else 'off'}-{seed}", band)
                print(json.dumps(run), flush=True)
                runs.append(run)

    def median(key: str, on: bool) -> float | None:
        values = [r[key] for r in runs if r["reservations"] == on and r[key] is not None]
        return statistics.median(values) if values else None

    summary = {f"{'on' if on else 'off'}": {key: median(key, on) for key in (
        "env_steps_per_second", "idle_share", "env_steps_used", "policy_lag_p50", "policy_lag_p95")}
        for on in (True, False)}
    on_rate, off_rate = summary["on"]["env_steps_per_second"], summary["off"]["env_steps_per_second"]
    loss = round(1 - on_rate / off_rate, 4) if on_rate and off_rate else None
    write("reservations" if band == 2 else f"reservations_band{band}", {
                           "workers": workers, "envs_per_worker": 4, "env_steps_per_second_per_env": 20,
                           "band_batches": band,
                           "budget_env_steps": steps, "median": summary,
                           "env_steps_per_second_lost_to_reservations": loss, "target": "<= 0.05",
                           "target_met": loss is not None and loss <= 0.05,
                           "used_target": ">= 0.97", "used_target_met": all(
                               (r["env_steps_used"] or 0) >= 0.97 for r in runs if r["reservations"]),
                           "runs": runs})


if __name__ == "__main__":
    main()
