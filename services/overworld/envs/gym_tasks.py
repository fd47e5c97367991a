"""Gymnasium classics for fast checks (CartPole, Acrobot), optionally at a slower game's pace."""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym


class Paced(gym.Wrapper):
    """Every step takes at least `step_seconds` (it sleeps what is left): a fast env stepped at the pace
    of a dear one (a Minecraft instance steps about every 50 ms), with the CPU left free, for fleets that
    must be sized to a learner (the autoscaling rehearsal)."""

    def __init__(self, env: gym.Env, step_seconds: float) -> None:
        super().__init__(env)
        self.step_seconds = step_seconds
        self._next = 0.0

    def reset(self, **kwargs: Any) -> Any:
        self._next = time.monotonic() + self.step_seconds
        return self.env.reset(**kwargs)

    def step(self, action: Any) -> Any:
        wait = self._next - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._next = max(self._next + self.step_seconds, time.monotonic())
        return self.env.step(action)


def make_env(id: str = "CartPole-v1", step_seconds: float = 0.0, **kwargs: Any) -> gym.Env:
    """`gym.make(id, **kwargs)`; with `step_seconds`, each step takes at least that long."""
    if step_seconds < 0:
        raise ValueError(f"step_seconds must be >= 0, not {step_seconds}")
    env = gym.make(id, **kwargs)
    return Paced(env, step_seconds) if step_seconds else env
