"""The IMPALA residual CNN (Espeholt et al. 2018), the encoder of the ResNet-PPO agents on Crafter.

Each stack: a 3x3 convolution to the stack's channels, a 3x3 max-pool of stride 2, then residual
blocks (ReLU, conv, ReLU, conv, plus the input). After the stacks: ReLU, flatten, a dense layer.
On Crafter's 64x64 frames three stacks leave an 8x8 map: one cell per view tile, near enough.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from overworld.core.specs import dict_space
from overworld.policies.nets import ActorCritic, _layer


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


class DownStack(nn.Module):
    def __init__(self, in_channels: int, channels: int, blocks: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, channels, 3, padding=1)
        self.blocks = nn.Sequential(*[ResidualBlock(channels) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(F.max_pool2d(self.conv(x), 3, stride=2, padding=1))


class ImpalaPolicy(ActorCritic):
    """IMPALA CNN -> dense -> (optional GRU) -> policy logits and value, for (H, W, C) uint8 images."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, key: str, channels: list[int],
                 blocks: int, hidden: int, recurrent: bool = False) -> None:
        image = dict_space(observation_space, "obs")[key]
        h, w, c = image.shape
        stacks: list[nn.Module] = []
        inp = c
        for ch in channels:
            stacks.append(DownStack(inp, ch, blocks))
            inp = ch
        conv = nn.Sequential(*stacks, nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            flat = conv(torch.zeros(1, c, h, w)).shape[-1]
        encoder = nn.Sequential(conv, _layer(flat, hidden), nn.ReLU())
        super().__init__(encoder, hidden, action_space, hidden, recurrent)
        self.key = key
        self.scale = 1 / 255.0 if image.dtype == np.uint8 else 1.0

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        x = obs[self.key]
        B, T = x.shape[:2]
        x = x.reshape(B * T, *x.shape[2:]).permute(0, 3, 1, 2).float() * self.scale
        return self.encoder(x).reshape(B, T, -1)


def make_impala_policy(observation_space: gym.Space, action_space: gym.Space, key: str = "obs",
                       channels: list[int] | None = None, blocks: int = 2, hidden: int = 256,
                       recurrent: bool = False) -> ImpalaPolicy:
    return ImpalaPolicy(observation_space, action_space, key, list(channels or [16, 32, 32]), blocks, hidden,
                        recurrent)
