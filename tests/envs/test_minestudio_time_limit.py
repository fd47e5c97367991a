"""MinecraftSim's episode ends through the adapter: MineStudio's JudgeResetCallback reports its time
limit as `terminated`; that is a truncation (bootstrapped), while the engine's own `done` (a death) is
a termination. MineStudio's callback module imports cv2 and the simulator's GUI, which even the
MineStudio test venv does not install, so the callback's counting is copied here line for line."""

from __future__ import annotations

from typing import Any

import numpy as np

from overworld.envs.minestudio import adapt_env
from tests.minestudio.minecraft_sim_standin import StandInSim


class CountingTimeLimit:
    """Counts like MineStudio's JudgeResetCallback (minestudio/simulator/callbacks/judgereset.py)."""

    def __init__(self, time_limit: int) -> None:
        self.time_limit, self.time_step = time_limit, 0

    def after_reset(self, sim: Any, obs: Any, info: Any) -> tuple[Any, Any]:
        self.time_step = 0
        return obs, info

    def after_step(self, sim: Any, obs: Any, reward: float, terminated: bool, truncated: bool,
                   info: Any) -> tuple[Any, float, bool, bool, Any]:
        self.time_step += 1
        if terminated or self.time_step > self.time_limit - 1:
            self.time_step = 0
            terminated = True
        return obs, reward, terminated, truncated, info


class SimWithCallbacks(StandInSim):
    """MinecraftSim.step and reset around the stand-in engine: `terminated, truncated = done, done`,
    then every callback's after_step."""

    def __init__(self, callbacks: list[Any], engine_episode: int) -> None:
        super().__init__(time_limit=engine_episode)
        self.callbacks = callbacks

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:
        obs, info = super().reset()
        for cb in self.callbacks:
            obs, info = cb.after_reset(self, obs, info)
        return obs, info

    def step(self, action: dict[str, Any]) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        for cb in self.callbacks:
            obs, reward, terminated, truncated, info = cb.after_step(self, obs, reward, terminated, truncated, info)
        return obs, reward, terminated, truncated, info


ACTION = {"buttons": np.int64(0), "camera": np.int64(60)}


def run_episode(env: Any) -> list[tuple[bool, bool]]:
    env.reset()
    flags = []
    while not flags or not any(flags[-1]):
        _, _, terminated, truncated, _ = env.step(ACTION)
        flags.append((terminated, truncated))
    return flags


def test_a_judge_reset_time_limit_is_a_truncation() -> None:
    env = adapt_env(SimWithCallbacks([CountingTimeLimit(6)], engine_episode=1000))
    for _ in range(2):  # the callback's counter starts over with every episode
        flags = run_episode(env)
        assert len(flags) == 6 and flags[-1] == (False, True)


def test_a_death_is_a_termination_even_at_the_time_limit() -> None:
    env = adapt_env(SimWithCallbacks([CountingTimeLimit(6)], engine_episode=4))
    flags = run_episode(env)
    assert len(flags) == 4 and flags[-1] == (True, False)
    env = adapt_env(SimWithCallbacks([CountingTimeLimit(6)], engine_episode=6))  # both on the same step
    assert run_episode(env)[-1] == (True, False)
