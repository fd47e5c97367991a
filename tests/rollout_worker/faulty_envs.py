"""Test environments that misbehave, for the env processes to import (`tests.rollout_worker.faulty_envs:...`).

Each counts steps across all its instances in one process through a file, so that a test can
make exactly one env of the fleet hang or die."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np


class Counting(gym.Env):
    """A 4-float observation, 2 actions, reward 1 per step, episodes of `length` steps (truncated)."""

    def __init__(self, length: int = 20, image: bool = False) -> None:
        self.length = length
        self.image = image
        self.observation_space = gym.spaces.Box(0, 255, (16, 16, 3), np.uint8) if image else \
            gym.spaces.Box(-1e6, 1e6, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def _obs(self) -> Any:
        if self.image:
            return np.full((16, 16, 3), (self.t * 10) % 256, np.uint8)
        return np.array([self.t, 0, 0, 0], np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        self.t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        self.t += 1
        truncated = self.t >= self.length
        info = {"achievements": {"achievement_count": float(self.t)}} if truncated else {}
        return self._obs(), 1.0, False, truncated, info


class Crashing(Counting):
    """Raises in step every `every` steps (of this instance)."""

    def __init__(self, every: int = 7, length: int = 20) -> None:
        super().__init__(length)
        self.every = every
        self.steps = 0

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        self.steps += 1
        if self.steps % self.every == 0:
            raise RuntimeError("simulated game crash")
        return super().step(action)


def _claim(flag: str) -> bool:
    """True exactly once per flag file (atomic create)."""
    try:
        fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.close(fd)
    return True


class Hanging(Counting):
    """The first instance (across processes) to reach `at` steps hangs forever in step."""

    def __init__(self, flag: str, at: int = 15, length: int = 20) -> None:
        super().__init__(length)
        self.flag, self.at, self.steps = flag, at, 0

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        self.steps += 1
        if self.steps == self.at and _claim(self.flag):
            time.sleep(3600)
        return super().step(action)


class Dying(Counting):
    """The first instance to reach `at` steps kills its own process (a game that segfaults)."""

    def __init__(self, flag: str, at: int = 15, length: int = 20) -> None:
        super().__init__(length)
        self.flag, self.at, self.steps = flag, at, 0

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        self.steps += 1
        if self.steps == self.at and _claim(self.flag):
            os._exit(17)
        return super().step(action)


class Paced(Counting):
    """Each step takes `seconds` (a game engine's pace): a fragment is under way long enough to be seen."""

    def __init__(self, seconds: float = 0.05, length: int = 20) -> None:
        super().__init__(length)
        self.seconds = seconds

    def step(self, action: int) -> tuple[Any, float, bool, bool, dict]:
        time.sleep(self.seconds)
        return super().step(action)


class SlowReset(Counting):
    """A reset that takes `seconds` (Crafter's world generation, Minecraft's respawn)."""

    def __init__(self, seconds: float = 0.3, length: int = 10) -> None:
        super().__init__(length)
        self.seconds = seconds

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        time.sleep(self.seconds)
        return super().reset(seed=seed)


def counting(length: int = 20, image: bool = False) -> Counting:
    return Counting(length, image)


def crashing(every: int = 7, length: int = 20) -> Crashing:
    return Crashing(every, length)


def hanging(flag: str, at: int = 15, length: int = 20) -> Hanging:
    return Hanging(flag, at, length)


def dying(flag: str, at: int = 15, length: int = 20) -> Dying:
    return Dying(flag, at, length)


def paced(seconds: float = 0.05, length: int = 20) -> Paced:
    return Paced(seconds, length)


def slow_reset(seconds: float = 0.3, length: int = 10) -> SlowReset:
    return SlowReset(seconds, length)


def flag_path(tmp: Path, name: str) -> str:
    return str(tmp / f"{name}.flag")
