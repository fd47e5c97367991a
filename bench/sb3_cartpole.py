"""Stable-Baselines3's PPO on CartPole-v1 with rl-zoo's tuned hyperparameters, until the mean return of
the last 100 episodes reaches the target. Runs in its own venv (`make .venv-sb3`), started by
bench/bench_e2e.py; prints one JSON line.

rl-baselines3-zoo, hyperparams/ppo.yml, CartPole-v1 ("Tuned"): n_envs 8, n_timesteps 1e5, MlpPolicy,
n_steps 32, batch_size 256, gae_lambda 0.8, gamma 0.98, n_epochs 20, ent_coef 0.0, learning_rate
lin_0.001, clip_range lin_0.2 (linear schedules over n_timesteps, as the zoo runs them); the rest are
SB3's defaults. Environments as the zoo makes them: make_vec_env (DummyVecEnv, Monitor).

    .venv-sb3/bin/python bench/sb3_cartpole.py SEED TARGET
"""

from __future__ import annotations

import json
import sys
import time

started = time.time()

import numpy as np  # noqa: E402
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.env_util import make_vec_env  # noqa: E402

N_TIMESTEPS = 100_000


def linear(initial: float):  # noqa: ANN201 - the zoo's lin_<value>
    return lambda progress_remaining: progress_remaining * initial


class StopAtTarget(BaseCallback):
    def __init__(self, target: float) -> None:
        super().__init__()
        self.target = target
        self.reached: dict[str, float] | None = None

    def _on_step(self) -> bool:
        episodes = self.model.ep_info_buffer  # the last 100 episodes (Monitor)
        if len(episodes) >= 100 and np.mean([e["r"] for e in episodes]) >= self.target:
            self.reached = {"env_steps": self.num_timesteps, "reached_unix": time.time()}
            return False
        return True


def main() -> None:
    seed, target = int(sys.argv[1]), float(sys.argv[2])
    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                ent_coef=0.0, learning_rate=linear(1e-3), clip_range=linear(0.2), seed=seed, device="cpu")
    stop = StopAtTarget(target)
    model.learn(total_timesteps=N_TIMESTEPS, callback=stop)
    episodes = model.ep_info_buffer
    print(json.dumps({"seed": seed, "started_unix": started, "reached": stop.reached,
                      "env_steps": model.num_timesteps, "wall_seconds": time.time() - started,
                      "mean_return_last_100": float(np.mean([e["r"] for e in episodes])) if episodes else None}))


if __name__ == "__main__":
    main()
