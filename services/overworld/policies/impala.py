"""The IMPALA residual CNN (Espeholt et al. 2018), the encoder of the ResNet-PPO agents on Crafter.

Two layouts of the same network: stacks of a 3x3 convolution to the stack's channels, a 3x3 max-pool
of stride 2, then residual blocks; after the stacks, dense layers. On Crafter's 64x64 frames three
stacks leave an 8x8 map: one cell per view tile, near enough.

- `norm=False` (IMPALA's own): residual blocks are ReLU, conv, ReLU, conv, plus the input; ReLU,
  flatten, then `dense` (optional) and `hidden` wide ReLU layers, orthogonally initialised.
- `norm=True` (the layout of OpenAI's VPT, which Moon et al.'s ResNet-PPO on Crafter uses): every
  convolution but the very first is preceded by a one-group GroupNorm (a LayerNorm over channels and
  space, per-channel affine) and followed by a ReLU, and so are both convolutions of a residual
  block (`x + unit(unit(x))`); a one-group GroupNorm after each max-pool; each dense layer is
  LayerNorm, Linear, ReLU. A layer followed by a norm has no bias. Weights are "fan-in" initialised:
  each output unit's weight vector is scaled to a fixed norm (1 for the convolutions, shrunk with
  depth inside the residual blocks; 1.4 for the first dense layer); the value head starts at
  orthogonal gain 0.1, the policy head at 0.01.
"""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from overworld.core.specs import dict_space
from overworld.policies.nets import ActorCritic, _layer, _shape


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


# -- the normalised (VPT) layout ---------------------------------------------------------------------
def _fan_in_(weight: torch.Tensor, scale: float) -> None:
    """Scale each output unit's weights (conv: over in-channels x kernel) to L2 norm `scale`."""
    with torch.no_grad():
        norms = weight.flatten(1).norm(dim=1).clamp(min=1e-12)
        weight.mul_((scale / norms).view(-1, *([1] * (weight.dim() - 1))))


class NormedUnit(nn.Module):
    """[norm of the input] -> 3x3 conv or linear -> ReLU. `norm`: "group" (one-group GroupNorm, for
    feature maps), "layer" (LayerNorm, for vectors) or None (the layer then has a bias, zeroed)."""

    def __init__(self, inp: int, out: int, norm: str | None, scale: float, conv: bool = True) -> None:
        super().__init__()
        self.norm = {"group": lambda: nn.GroupNorm(1, inp), "layer": lambda: nn.LayerNorm(inp),
                     None: lambda: nn.Identity()}[norm]()
        self.layer = (nn.Conv2d(inp, out, 3, padding=1, bias=norm is None) if conv
                      else nn.Linear(inp, out, bias=norm is None))
        _fan_in_(self.layer.weight, scale)
        if self.layer.bias is not None:
            nn.init.zeros_(self.layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.layer(self.norm(x)))


class NormedResidualBlock(nn.Module):
    def __init__(self, channels: int, scale: float) -> None:
        super().__init__()
        self.unit0 = NormedUnit(channels, channels, "group", scale)
        self.unit1 = NormedUnit(channels, channels, "group", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.unit1(self.unit0(x))


class NormedDownStack(nn.Module):
    """Conv (normalised input unless it is the network's first), max-pool, GroupNorm, residual blocks.
    `scale`: the stack's share of the initial output scale; each of its blocks' convolutions gets
    sqrt(scale / sqrt(blocks))."""

    def __init__(self, in_channels: int, channels: int, blocks: int, first: bool, scale: float) -> None:
        super().__init__()
        self.conv = NormedUnit(in_channels, channels, None if first else "group", 1.0)
        self.pool_norm = nn.GroupNorm(1, channels)
        block_scale = math.sqrt(scale / math.sqrt(blocks))
        self.blocks = nn.Sequential(*[NormedResidualBlock(channels, block_scale) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.pool_norm(F.max_pool2d(self.conv(x), 3, stride=2, padding=1)))


def impala_encoder(shape: tuple[int, int, int], channels: list[int], blocks: int, hidden: int,
                   dense: int | None = None, norm: bool = False) -> nn.Sequential:
    """(N, C, H, W) floats in [0, 1] -> (N, hidden) features."""
    c, h, w = shape
    stacks: list[nn.Module] = []
    inp = c
    for i, ch in enumerate(channels):
        stacks.append(NormedDownStack(inp, ch, blocks, first=i == 0, scale=1 / math.sqrt(len(channels))) if norm
                      else DownStack(inp, ch, blocks))
        inp = ch
    conv = nn.Sequential(*stacks, nn.Flatten()) if norm else nn.Sequential(*stacks, nn.ReLU(), nn.Flatten())
    with torch.no_grad():
        flat = conv(torch.zeros(1, c, h, w)).shape[-1]
    sizes = [flat, *([dense] if dense else []), hidden]
    layers: list[nn.Module] = [conv]
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        if norm:  # the first dense layer starts at scale 1.4 (it follows no ReLU'd norm), the next at 1
            layers.append(NormedUnit(a, b, "layer", 1.4 if i == 0 else 1.0, conv=False))
        else:
            layers += [_layer(a, b), nn.ReLU()]
    return nn.Sequential(*layers)


class ImpalaPolicy(ActorCritic):
    """IMPALA CNN -> [dense] -> hidden -> (optional GRU) -> policy logits and value, for (H, W, C) images."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, key: str, channels: list[int],
                 blocks: int, hidden: int, recurrent: bool = False, dense: int | None = None, norm: bool = False,
                 value_norm_beta: float | None = None) -> None:
        image = dict_space(observation_space, "obs")[key]
        h, w, c = _shape(image, key)
        encoder = impala_encoder((c, h, w), channels, blocks, hidden, dense, norm)
        super().__init__(encoder, hidden, action_space, hidden, recurrent)
        if norm:
            nn.init.orthogonal_(self.value_head.weight, 0.1)
        if value_norm_beta is not None:
            self.value_normalizer.beta = value_norm_beta
        self.key = key
        self.scale = 1 / 255.0 if image.dtype == np.uint8 else 1.0

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        x = obs[self.key]
        B, T = x.shape[:2]
        x = x.reshape(B * T, *x.shape[2:]).permute(0, 3, 1, 2).float() * self.scale
        return self.encoder(x).reshape(B, T, -1)


def make_impala_policy(observation_space: gym.Space, action_space: gym.Space, key: str = "obs",
                       channels: list[int] | None = None, blocks: int = 2, hidden: int = 256,
                       recurrent: bool = False, dense: int | None = None, norm: bool = False,
                       value_norm_beta: float | None = None) -> ImpalaPolicy:
    """`dense`: a layer of that width between the CNN and the `hidden` layer; `norm`: the VPT layout
    (module docstring); `value_norm_beta`: the value normaliser's EWMA decay per iteration (None:
    the normaliser's default, VPT's)."""
    return ImpalaPolicy(observation_space, action_space, key, list(channels or [16, 32, 32]), blocks, hidden,
                        recurrent, dense, norm, value_norm_beta)
