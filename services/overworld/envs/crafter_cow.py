"""Crafter's open world as MineStudio's kill-cow quick start.

MineStudio's quick start: cows summoned around the player, an iron sword, strength, reward 1.0
for each cow killed (at most 30), 1000 steps per episode. Here: Crafter with its own rewards off,
`num_cows` extra cows placed on grass near the spawn, the player given a sword (`sword`: a cow
falls to one hit of an iron sword, to three bare-handed), a sturdier player (MineStudio's potion),
reward 1.0 for each cow eaten (Crafter's kill), at most `max_reward_times`, `timestep_limit` steps.
Termination is death; the time limit is truncation.
"""

from __future__ import annotations

from typing import Any

import crafter
import gymnasium as gym
import numpy as np
from crafter import objects

from overworld.envs.crafter_score import score_summary
from overworld.envs.task_metrics import TaskMetrics


class CrafterCow(gym.Env):
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, size: int = 64, area: int = 32, timestep_limit: int = 1000, num_cows: int = 10, spawn_range: int = 5,
                 max_reward_times: int = 30, player_health: int = 9, sword: str | None = "iron",
                 seed: int | None = None) -> None:
        if sword not in (None, "wood", "stone", "iron"):
            raise ValueError(f"sword must be one of wood, stone, iron or None, got {sword!r}")
        # A 32x32 world instead of Crafter's 64x64: the cows are summoned near the spawn anyway, and
        # world generation (most of a reset) is ~6x cheaper.
        self._env = crafter.Env(area=(area, area), size=(size, size), reward=False, length=None, seed=seed)
        self.observation_space = gym.spaces.Box(0, 255, (size, size, 3), np.uint8)
        self.action_space = gym.spaces.Discrete(len(crafter.constants.actions))
        self.timestep_limit = timestep_limit
        self.num_cows = num_cows
        self.spawn_range = spawn_range
        self.max_reward_times = max_reward_times
        self.player_health = player_health
        self.sword = sword
        self._rng = np.random.default_rng(seed)
        self._steps = 0
        self._cows_eaten = 0

    def _summon_cows(self) -> None:
        world, player = self._env._world, self._env._player
        px, py = player.pos
        placed, tries = 0, 0
        while placed < self.num_cows and tries < 50 * self.num_cows:
            tries += 1
            dx, dy = self._rng.integers(-self.spawn_range, self.spawn_range + 1, size=2)
            pos = (int(px + dx), int(py + dy))
            if (dx, dy) == (0, 0) or not (0 <= pos[0] < world.area[0] and 0 <= pos[1] < world.area[1]):
                continue
            if world[pos][0] == "grass" and world[pos][1] is None:
                world.add(objects.Cow(world, pos))
                placed += 1

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        if seed is not None:
            self._env._seed = seed
            self._rng = np.random.default_rng(seed)
        obs = self._env.reset()
        self._env._player.health = self.player_health
        if self.sword:
            self._env._player.inventory[f"{self.sword}_sword"] = 1
        self._summon_cows()
        self._steps = 0
        self._cows_eaten = 0
        return obs, {}

    def step(self, action: int) -> tuple[np.ndarray, float, bool, bool, dict]:
        obs, _, done, info = self._env.step(int(action))
        self._steps += 1
        eaten = info["achievements"]["eat_cow"]
        reward = 0.0
        if eaten > self._cows_eaten and self._cows_eaten < self.max_reward_times:
            reward = float(eaten - self._cows_eaten)
        self._cows_eaten = eaten
        terminated = info["discount"] == 0.0
        truncated = not terminated and self._steps >= self.timestep_limit
        achievements = {f"achievement_{k}": float(v > 0) for k, v in info["achievements"].items()}
        return obs, reward, terminated, truncated, {"achievements": achievements, "cows_eaten": float(eaten)}

    def render(self) -> np.ndarray:
        return self._env.render()


def make_env(**kwargs: Any) -> CrafterCow:
    return CrafterCow(**kwargs)


# What `overworld run` reports of this task beyond return and length (overworld.envs.task_metrics):
# these extras on the learning curve, and Crafter's score over all the run's episodes.
TASK_METRICS = TaskMetrics(curve_extras=("cows_eaten", "achievement_eat_cow"), scores={"crafter": score_summary})
