"""Gymnasium classics for fast checks (CartPole, Acrobot)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym


def make_env(id: str = "CartPole-v1", **kwargs: Any) -> gym.Env:
    return gym.make(id, **kwargs)
