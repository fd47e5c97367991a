"""Spaces: the names, shapes and dtypes of observations, actions and recurrent state."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np

from overworld.v1 import common_pb2


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    def check(self, name: str, array: np.ndarray, leading: tuple[int, ...] = ()) -> None:
        expected = leading + self.shape
        if array.dtype != np.dtype(self.dtype):
            raise ValueError(f"{name}: dtype {array.dtype}, expected {self.dtype}")
        if array.shape != expected:
            raise ValueError(f"{name}: shape {array.shape}, expected {expected}")


@dataclass(frozen=True)
class Spaces:
    obs: dict[str, TensorSpec]
    action: dict[str, TensorSpec]
    state: dict[str, TensorSpec] = field(default_factory=dict)
    # Number of choices per discrete action component (for policies); not on the wire.
    action_sizes: dict[str, int] = field(default_factory=dict, compare=False)

    def to_proto(self) -> common_pb2.Spaces:
        def specs(d: dict[str, TensorSpec]) -> list[common_pb2.TensorSpec]:
            return [common_pb2.TensorSpec(name=k, shape=list(v.shape), dtype=v.dtype) for k, v in sorted(d.items())]

        return common_pb2.Spaces(obs=specs(self.obs), action=specs(self.action), state=specs(self.state))

    @staticmethod
    def from_proto(msg: common_pb2.Spaces) -> Spaces:
        def specs(items: Iterable[common_pb2.TensorSpec]) -> dict[str, TensorSpec]:
            out: dict[str, TensorSpec] = {}
            for s in items:
                np.dtype(s.dtype)  # raises TypeError on an unknown dtype
                out[s.name] = TensorSpec(tuple(int(d) for d in s.shape), s.dtype)
            return out

        return Spaces(obs=specs(msg.obs), action=specs(msg.action), state=specs(msg.state))


def _box_or_discrete(space: gym.Space) -> TensorSpec:
    if isinstance(space, gym.spaces.Discrete):
        return TensorSpec((), "int64")
    if isinstance(space, gym.spaces.MultiDiscrete | gym.spaces.Box | gym.spaces.MultiBinary):
        return TensorSpec(tuple(space.shape), np.dtype(space.dtype).name)
    raise TypeError(f"unsupported space {space}")


def dict_space(space: gym.Space, default_key: str) -> dict[str, gym.Space]:
    """Observations and actions are dicts of tensors; a plain space becomes {default_key: space}."""
    if isinstance(space, gym.spaces.Dict):
        return dict(space.spaces)
    return {default_key: space}


def spaces_from_gym(observation_space: gym.Space, action_space: gym.Space,
                    state: dict[str, TensorSpec] | None = None) -> Spaces:
    obs = {k: _box_or_discrete(s) for k, s in dict_space(observation_space, "obs").items()}
    acts = dict_space(action_space, "action")
    action = {k: _box_or_discrete(s) for k, s in acts.items()}
    sizes = {k: int(s.n) for k, s in acts.items() if isinstance(s, gym.spaces.Discrete)}
    return Spaces(obs=obs, action=action, state=state or {}, action_sizes=sizes)
