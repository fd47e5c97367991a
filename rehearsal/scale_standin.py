"""A Minecraft-speed stand-in for the scale rehearsal (docs/operations.md, "Scale"): an environment that
steps at MinecraftSim's pace with pixel observations, and a policy whose weights are as large as asked
while its inference stays cheap, so that a fleet of 32 pods fits two CPU cores and the links, not the
CPU, bound each weights push.

- `make_env`: 64x64x3 frames at 20 steps/s (each step sleeps what is left of its 50 ms, as a worker
  waits on MinecraftSim's engine), 8 discrete actions, 200-step episodes (truncated). The reward is
  1 for the action that the frame's dominant colour names: a policy can learn it.
- `make_policy`: the frame average-pooled to 8x8x3, a 64-wide layer, and a "ballast" embedding table
  sized by `weights_mb` (one row looked up per frame from the pooled frame's hash): the weights a push
  carries are `weights_mb`, the forward pass costs microseconds.
"""

from __future__ import annotations

import time
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from overworld.policies.nets import ActorCritic, _layer

STEP_SECONDS = 0.05  # MinecraftSim steps at ~20 per second
ACTIONS = 8
EPISODE_STEPS = 200
SIZE = 64


class PacedEnv(gym.Env):
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, step_seconds: float = STEP_SECONDS, episode_steps: int = EPISODE_STEPS) -> None:
        self.observation_space = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (SIZE, SIZE, 3), np.uint8)})
        self.action_space = gym.spaces.Discrete(ACTIONS)
        self.step_seconds, self.episode_steps = step_seconds, episode_steps
        # frames drawn once: one per action, a dominant colour with some texture
        rng = np.random.default_rng(0)
        palette = rng.integers(0, 256, (ACTIONS, 3))
        self.frames = [np.clip(palette[a] + rng.integers(-24, 24, (SIZE, SIZE, 3)), 0, 255).astype(np.uint8)
                       for a in range(ACTIONS)]
        self._rng = np.random.default_rng()
        self._target = 0
        self._t = 0
        self._next = 0.0

    def _obs(self) -> dict[str, np.ndarray]:
        self._target = int(self._rng.integers(ACTIONS))
        return {"image": self.frames[self._target]}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._t = 0
        self._next = time.monotonic() + self.step_seconds
        return self._obs(), {}

    def step(self, action: Any) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        reward = float(int(action) == self._target)
        wait = self._next - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._next = max(self._next + self.step_seconds, time.monotonic())
        self._t += 1
        return self._obs(), reward, False, self._t >= self.episode_steps, {}


def make_env(step_seconds: float = STEP_SECONDS, episode_steps: int = EPISODE_STEPS) -> PacedEnv:
    return PacedEnv(step_seconds, episode_steps)


class BallastPolicy(ActorCritic):
    def __init__(self, observation_space: gym.Space, action_space: gym.Space, weights_mb: float, hidden: int) -> None:
        encoder = nn.Sequential(_layer(8 * 8 * 3, hidden), nn.ReLU())
        super().__init__(encoder, hidden, action_space, hidden, recurrent=False)
        rows = max(1, int(weights_mb * 1e6 / 4 / hidden))
        self.ballast = nn.Embedding(rows, hidden)
        nn.init.normal_(self.ballast.weight, std=1e-3)

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        x = obs["image"]
        B, T = x.shape[:2]
        pooled = F.avg_pool2d(x.reshape(B * T, SIZE, SIZE, 3).permute(0, 3, 1, 2).float(), SIZE // 8) / 255.0
        flat = pooled.flatten(1)
        row = (flat * 1000).long().sum(-1) % self.ballast.num_embeddings
        return (self.encoder(flat) + self.ballast(row)).reshape(B, T, -1)


def make_policy(observation_space: gym.Space, action_space: gym.Space, weights_mb: float = 48.0,
                hidden: int = 64) -> BallastPolicy:
    return BallastPolicy(observation_space, action_space, weights_mb, hidden)
