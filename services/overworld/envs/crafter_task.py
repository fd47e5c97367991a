"""The Crafter benchmark task, unmodified: `crafter.Env` with its defaults (a 64x64 world, a 9x9 view
rendered at 64x64 pixels, Crafter's own reward, 10,000-step episodes), seen through gymnasium's API.

Crafter reports an episode's end as `done`; here a death (Crafter's `discount == 0`) is a termination
and the 10,000-step limit a truncation, so the learner bootstraps at the time limit. Each step's info
carries the episode's 22 achievements as `achievement_<name>` = 1.0 when unlocked at least once so
far (the rollout worker reports the final step's values with the episode), which is what the
benchmark's success rates count (overworld.envs.crafter_score).
"""

from __future__ import annotations

from typing import Any

import crafter
import gymnasium as gym
import numpy as np

from overworld.envs.crafter_score import score_summary
from overworld.envs.task_metrics import TaskMetrics


class CrafterTask(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, seed: int | None = None) -> None:
        self._env = crafter.Env(seed=seed)
        self.observation_space = gym.spaces.Box(0, 255, (64, 64, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(len(crafter.constants.actions))

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self._env._seed = seed  # crafter.Env derives each episode's world from (seed, episode number)
        return self._env.reset(), {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, reward, done, info = self._env.step(int(action))
        terminated = info["discount"] == 0.0
        truncated = bool(done) and not terminated
        achievements = {f"achievement_{k}": float(v > 0) for k, v in info["achievements"].items()}
        return obs, float(reward), terminated, truncated, {"achievements": achievements}

    def render(self) -> np.ndarray:
        return self._env.render()


def make_env(seed: int | None = None) -> CrafterTask:
    return CrafterTask(seed)


# What `overworld run` reports of this task beyond return and length (overworld.envs.task_metrics):
# these extras on the learning curve, and Crafter's score over all the run's episodes.
TASK_METRICS = TaskMetrics(curve_extras=("achievement_eat_cow",), scores={"crafter": score_summary})
