"""Overworld end to end, next to single-process baselines on the same machine, in one run:

1. CartPole-v1 to a 100-episode mean return of 450, seed by seed, alternating: Stable-Baselines3's PPO
   with rl-zoo's tuned hyperparameters (bench/sb3_cartpole.py, in .venv-sb3: `make .venv-sb3`) and
   `overworld run examples/cartpole.yaml`. Env steps and wall time from process start, and the ratios.
2. From the same Overworld runs' summaries, never from their logs' wording: the startup timeline
   (seconds from `overworld run` to each of the launcher's startup milestones, overworld/launch/
   milestones.py: each service serving, a worker registered, the first version published, the first
   version swapped in at a worker, the trainer training, its first update) and the iteration timeline
   (sample -> values -> gae -> PPO epochs -> publish, from the trainer's per-iteration timings on the
   learning curve; publish -> swapped in at the workers, from the registry's push status there).
3. The Crafter cow task: env steps/s through the whole pipeline (learner included, once training
   runs) next to bare Crafter processes stepping random actions on the same cores.
4. CartPole stepped in a bare loop with random actions, for scale.

    python -m bench.bench_e2e            -> bench/results/e2e.json

Knobs (environment): BENCH_SEEDS (0,1,2), BENCH_TARGET (450), BENCH_CARTPOLE_STEPS (200000, the cap of
one Overworld seed), BENCH_CRAFTER_STEPS (40000), BENCH_SB3_PYTHON (.venv-sb3/bin/python).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from bench.runs import ROOT, RunRecord, overworld_run, write
from overworld.launch.milestones import STARTUP_MILESTONES

NUM_ENVS = 8  # as examples/cartpole.yaml and rl-zoo
TIMINGS = ("sample", "values", "gae", "update", "publish", "post_iteration", "iteration")


def bare_loop_steps_per_second(seconds: float = 10.0) -> float:
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(NUM_ENVS)])
    envs.reset(seed=0)
    rng = np.random.default_rng(0)
    steps, started = 0, time.monotonic()
    while time.monotonic() - started < seconds:
        envs.step(rng.integers(0, 2, NUM_ENVS))
        steps += NUM_ENVS
    envs.close()
    return steps / (time.monotonic() - started)


def startup_timeline(summary: dict[str, Any], spawned: float) -> dict[str, float | None]:
    """Seconds from `overworld run` being started (`spawned`, unix) to each startup milestone the run's
    summary records (None: not reached)."""
    reached = summary.get("milestones") or {}
    return {name: round(reached[name] - spawned, 2) if reached.get(name) else None for name in STARTUP_MILESTONES}


def iteration_timeline(summary: dict[str, Any]) -> dict[str, float | None]:
    """Median seconds of each part of an iteration over the run's progress samples (each one the last
    iteration's timings), and the median push latency publish -> every worker swapped the version in
    (each sample the registry's latest complete push)."""
    curve = summary.get("curve", [])
    points = [p for p in curve if p.get("trainer/iteration_seconds")]
    out: dict[str, float | None] = {
        part: round(statistics.median(p[f"trainer/{part}_seconds"] for p in points), 4) if points else None
        for part in TIMINGS if all(f"trainer/{part}_seconds" in p for p in points)}
    pushes = [p["registry/push_seconds"] for p in curve if p.get("registry/push_seconds") is not None]
    out["publish_to_swapped_in_at_workers"] = round(statistics.median(pushes), 4) if pushes else None
    out["iterations_sampled"] = len(points)
    return out


def sb3_seed(seed: int, target: float) -> dict[str, Any]:
    python = os.environ.get("BENCH_SB3_PYTHON", str(ROOT / ".venv-sb3" / "bin" / "python"))
    with RunRecord() as record:
        spawned = time.time()
        out = subprocess.run([python, str(ROOT / "bench" / "sb3_cartpole.py"), str(seed), str(target)],
                             capture_output=True, text=True, timeout=1800, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    reached = result["reached"]
    return {"reached": reached is not None, "env_steps_to_target": reached["env_steps"] if reached else None,
            "wall_seconds_to_target": round(reached["reached_unix"] - spawned, 2) if reached else None,
            "env_steps": result["env_steps"], "mean_return_last_100": result["mean_return_last_100"],
            **record.fields}


def overworld_seed(seed: int, target: float, max_steps: int, tmp: Path) -> dict[str, Any]:
    workdir = tmp / f"cartpole-seed{seed}"
    with RunRecord() as record:
        spawned = time.time()
        summary = overworld_run("examples/cartpole.yaml", workdir, "--max-env-steps", str(max_steps),
                                "--target-return", str(target), "--set", f"seed={seed}")
    reached = summary.get("status") == "target_reached"
    return {"reached": reached, "env_steps_to_target": summary.get("steps_to_target"),
            "wall_seconds_to_target": round(summary["target_reached_unix"] - spawned, 2) if reached else None,
            "status": summary.get("status"), "env_steps": summary.get("env_steps"),
            "mean_return_last_100": summary.get("mean_return_last_100"),
            "env_steps_used": summary.get("env_steps_used"),
            "startup": startup_timeline(summary, spawned), "iteration": iteration_timeline(summary),
            "curve": summary.get("curve", []), **record.fields}


def crafter_pipeline(max_steps: int, tmp: Path) -> dict[str, Any]:
    """Env steps/s of the whole pipeline once training runs (from the first progress point with env steps
    to the last), so that the start cost, reported apart, does not dilute it."""
    with RunRecord() as record:
        spawned = time.time()
        summary = overworld_run("examples/crafter_cow.yaml", tmp / "crafter", "--max-env-steps", str(max_steps))
    curve = [p for p in summary.get("curve", []) if p["env_steps"] > 0]
    rate = ((curve[-1]["env_steps"] - curve[0]["env_steps"]) / (curve[-1]["wall_seconds"] - curve[0]["wall_seconds"])
            if len(curve) >= 2 else None)
    return {"status": summary.get("status"), "env_steps": summary.get("env_steps"),
            "env_steps_per_second_training": round(rate, 1) if rate else None,
            "env_steps_per_second_with_startup": summary.get("env_steps_per_second"),
            "updates": summary.get("updates"), "env_steps_used": summary.get("env_steps_used"),
            "env_steps_not_trained": summary.get("env_steps_not_trained"), "idle_share": summary.get("idle_share"),
            "startup": startup_timeline(summary, spawned), **record.fields}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(sb3: dict[str, Any], overworld: dict[str, Any], seeds: int) -> dict[str, Any]:
    ow_runs, sb3_runs = list(overworld.values()), list(sb3.values())
    summary = {
        "overworld_wall_seconds_to_target_median": median_of(ow_runs, "wall_seconds_to_target"),
        "sb3_wall_seconds_to_target_median": median_of(sb3_runs, "wall_seconds_to_target"),
        "overworld_env_steps_to_target_median": median_of(ow_runs, "env_steps_to_target"),
        "sb3_env_steps_to_target_median": median_of(sb3_runs, "env_steps_to_target"),
        "seeds_reaching_target": {"overworld": sum(r["reached"] for r in ow_runs),
                                  "sb3": sum(r["reached"] for r in sb3_runs), "of": seeds},
        "startup_median": {k: median_of([r["startup"] for r in ow_runs], k) for k in STARTUP_MILESTONES},
        "iteration_median": {k: median_of([r["iteration"] for r in ow_runs], k)
                             for k in [*TIMINGS, "publish_to_swapped_in_at_workers"]},
    }
    summary["wall_ratio_overworld_to_sb3"] = ratio(summary["overworld_wall_seconds_to_target_median"],
                                                   summary["sb3_wall_seconds_to_target_median"])
    summary["env_steps_ratio_overworld_to_sb3"] = ratio(summary["overworld_env_steps_to_target_median"],
                                                        summary["sb3_env_steps_to_target_median"])
    return summary


def main() -> None:
    from bench.bench_rollout_worker import bare_processes, crafter_kwargs

    seeds = [int(s) for s in os.environ.get("BENCH_SEEDS", "0,1,2").split(",")]
    target = float(os.environ.get("BENCH_TARGET", 450))
    max_steps = int(os.environ.get("BENCH_CARTPOLE_STEPS", 200_000))
    result: dict[str, Any] = {"target_return": target, "summary": {}, "sb3": {}, "overworld": {},
                              "sb3_hyperparameters": "rl-baselines3-zoo hyperparams/ppo.yml CartPole-v1 "
                                                     "(bench/sb3_cartpole.py)"}
    sb3, overworld = result["sb3"], result["overworld"]
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:  # alternating, so that a change in the machine's load hits both alike
            sb3[str(seed)] = sb3_seed(seed, target)
            print("sb3 seed", seed, sb3[str(seed)], flush=True)
            overworld[str(seed)] = overworld_seed(seed, target, max_steps, Path(tmp))
            print("overworld seed", seed, {k: v for k, v in overworld[str(seed)].items() if k != "curve"}, flush=True)
            result["summary"] = summarize(sb3, overworld, len(seeds))
            write("e2e", result)  # after every seed: a run cut short keeps what it measured
        crafter = crafter_pipeline(int(os.environ.get("BENCH_CRAFTER_STEPS", 40_000)), Path(tmp))
    bare_crafter = bare_processes(2, 20.0, crafter_kwargs())
    crafter["bare_processes_2_env_steps_per_second"] = round(bare_crafter["env_steps_per_second"], 1)
    crafter["pipeline_vs_bare"] = ratio(crafter["env_steps_per_second_training"], bare_crafter["env_steps_per_second"])
    result["crafter_cow"] = crafter
    result["cartpole_bare_loop_env_steps_per_second"] = round(bare_loop_steps_per_second(), 1)
    print(json.dumps(result["summary"], indent=2), crafter, flush=True)
    write("e2e", result)


if __name__ == "__main__":
    main()
