"""End-to-end speed on CartPole: env steps/s and time to a 100-episode mean return of 450 through all
services, next to the same environments stepped in a bare loop on the same cores, in the same run.

    python bench/bench_e2e.py            -> bench/results/e2e_cartpole.json
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np

from bench.runs import overworld_run, write

NUM_ENVS = 8  # as examples/cartpole.yaml


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


def main() -> None:
    bare = bare_loop_steps_per_second()
    print(f"bare loop: {bare:,.0f} env steps/s")
    with tempfile.TemporaryDirectory() as tmp:
        summary = overworld_run("examples/cartpole.yaml", Path(tmp) / "run", "--max-env-steps", "200000",
                                "--target-return", "450")
    result = {
        "bare_loop_env_steps_per_second": round(bare, 1),
        "overworld_env_steps_per_second": summary.get("env_steps_per_second"),
        "overworld_vs_bare": round((summary.get("env_steps_per_second") or 0) / bare, 3),
        "status": summary.get("status"),
        "steps_to_450": summary.get("steps_to_target"),
        "wall_seconds_to_450": summary.get("wall_seconds") if summary.get("status") == "target_reached" else None,
        "reference": {"cleanrl_ppo_steps_to_450": "195k-267k (21-29 s)", "rllib_ppo_steps_to_450": "68k-94k (90-116 s)",
                      "source": "shared/minestudio-notes.md, measured on this machine"},
        "curve": summary.get("curve", []),
    }
    print({k: v for k, v in result.items() if k != "curve"})
    write("e2e_cartpole", result)


if __name__ == "__main__":
    main()
