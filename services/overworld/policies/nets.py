"""Small MLP and CNN policies, each with an optional GRU core."""

from __future__ import annotations

from typing import cast

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from overworld.core.specs import dict_space
from overworld.policies.base import Policy, PolicyOutput, State, reset_state


def _layer(inp: int, out: int, gain: float = float(np.sqrt(2))) -> nn.Linear:
    layer = nn.Linear(inp, out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _shape(space: gym.Space, what: str) -> tuple[int, ...]:
    """The shape of an observation's space: a space without one (a nested Dict, a Text) is no tensor."""
    if space.shape is None:
        raise TypeError(f"observation {what!r}: a {type(space).__name__} space has no shape")
    return space.shape


def _mlp(sizes: list[int], activation: type[nn.Module]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:], strict=True):
        layers += [_layer(a, b), activation()]
    return nn.Sequential(*layers)


class RecurrentCore(nn.Module):
    """A GRU cell stepped over time; the state is reset where `first` is set."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.cell = nn.GRUCell(size, size)

    def forward(self, x: torch.Tensor, state: State, first: torch.Tensor) -> tuple[torch.Tensor, State]:
        outs = []
        for t in range(x.shape[1]):
            state = reset_state(state, first[:, t])
            h = self.cell(x[:, t], state["h"])
            state = {"h": h}
            outs.append(h)
        return torch.stack(outs, 1), state


class ActorCritic(Policy):
    """Encoder -> (optional GRU) -> policy logits per action component and a value."""

    def __init__(self, encoder: nn.Module, feature_size: int, action_space: gym.Space, hidden: int,
                 recurrent: bool) -> None:
        super().__init__()
        self.encoder = encoder
        self.core = RecurrentCore(feature_size) if recurrent else None
        self.policy_head = nn.ModuleDict({
            # every action component is Discrete (a space without n fails here, as it always did)
            k: _layer(feature_size, int(cast(gym.spaces.Discrete, s).n), gain=0.01)
            for k, s in dict_space(action_space, "action").items()
        })
        self.value_head = _layer(feature_size, 1, gain=1.0)
        self.hidden = hidden

    def initial_state(self, batch_size: int) -> State:
        if self.core is None:
            return {}
        return {"h": torch.zeros(batch_size, self.core.size, device=self.value_head.weight.device)}

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, obs: dict[str, torch.Tensor], state: State, first: torch.Tensor) -> tuple[PolicyOutput, State]:
        x = self.encode(obs)
        if self.core is not None:
            x, state = self.core(x, state, first)
        logits = {k: head(x) for k, head in self.policy_head.items()}
        return PolicyOutput(logits, self.value_head(x).squeeze(-1)), state

    def value_head_modules(self) -> list[nn.Module]:
        return [self.value_head]

    def encoder_modules(self) -> list[nn.Module]:
        return [self.encoder]


class MLPPolicy(ActorCritic):
    """Separate actor and critic MLPs over the concatenated flat observations."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, hidden_sizes: list[int],
                 recurrent: bool = False, activation: str = "tanh") -> None:
        obs_spaces = dict_space(observation_space, "obs")
        inp = sum(int(np.prod(_shape(s, k))) for k, s in obs_spaces.items())
        act = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]
        encoder = _mlp([inp, *hidden_sizes], act)
        super().__init__(encoder, hidden_sizes[-1], action_space, hidden_sizes[-1], recurrent)
        self.keys = sorted(obs_spaces)
        self.scale = {k: 1 / 255.0 if s.dtype == np.uint8 else 1.0 for k, s in obs_spaces.items()}
        # A separate value trunk: CartPole-sized problems learn faster without a shared body.
        self.value_encoder = _mlp([inp, *hidden_sizes], act)

    def _flat(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [obs[k].flatten(2).float() * self.scale[k] for k in self.keys]
        return torch.cat(parts, -1)

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.encoder(self._flat(obs))

    def forward(self, obs: dict[str, torch.Tensor], state: State, first: torch.Tensor) -> tuple[PolicyOutput, State]:
        out, state = super().forward(obs, state, first)
        if self.core is None:
            out.vpred = self.value_head(self.value_encoder(self._flat(obs))).squeeze(-1)
        return out, state

    def encoder_modules(self) -> list[nn.Module]:
        return [self.encoder, self.value_encoder]


class CNNPolicy(ActorCritic):
    """A small convolutional encoder for (H, W, C) uint8 images (Crafter's 64x64)."""

    def __init__(self, observation_space: gym.Space, action_space: gym.Space, key: str, channels: list[int],
                 hidden: int, recurrent: bool = False) -> None:
        image = dict_space(observation_space, "obs")[key]
        h, w, c = _shape(image, key)
        convs: list[nn.Module] = []
        inp = c
        for i, ch in enumerate(channels):
            convs += [nn.Conv2d(inp, ch, 4 if i == 0 else 3, stride=2, padding=1), nn.ReLU()]
            inp = ch
        convs.append(nn.Flatten())
        conv = nn.Sequential(*convs)
        with torch.no_grad():
            flat = conv(torch.zeros(1, c, h, w)).shape[-1]
        encoder = nn.Sequential(conv, _layer(flat, hidden), nn.ReLU())
        super().__init__(encoder, hidden, action_space, hidden, recurrent)
        self.key = key

    def encode(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        x = obs[self.key]
        B, T = x.shape[:2]
        x = x.reshape(B * T, *x.shape[2:]).permute(0, 3, 1, 2).float() / 255.0
        return self.encoder(x).reshape(B, T, -1)


def make_mlp_policy(observation_space: gym.Space, action_space: gym.Space, hidden_sizes: list[int] | None = None,
                    recurrent: bool = False, activation: str = "tanh") -> MLPPolicy:
    return MLPPolicy(observation_space, action_space, list(hidden_sizes or [64, 64]), recurrent, activation)


def make_cnn_policy(observation_space: gym.Space, action_space: gym.Space, key: str = "obs",
                    channels: list[int] | None = None, hidden: int = 256, recurrent: bool = False) -> CNNPolicy:
    return CNNPolicy(observation_space, action_space, key, list(channels or [32, 64, 64, 64]), hidden, recurrent)
