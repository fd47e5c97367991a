"""From sampled chunks to a training batch: chains of consecutive steps of one env slot.

A batch lives in host memory; `to_device` moves the part in use (a group of chains, a window, a
minibatch) to the learner's device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from overworld.core.wire.fragment import Fragment
from overworld.v1 import replay_buffer_pb2


@dataclass
class Batch:
    """B chains of L steps. obs/action: dicts of (B, L, ...); state: dicts of (B, ...)."""

    obs: dict[str, torch.Tensor]
    next_obs: dict[str, torch.Tensor]  # (B, 1, ...)
    action: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    first: torch.Tensor
    behaviour_logp: torch.Tensor
    behaviour_value: torch.Tensor
    bootstrap_value: torch.Tensor
    model_version: torch.Tensor
    # Filled by the learner before the update:
    advantage: torch.Tensor | None = None
    value_target: torch.Tensor | None = None
    old_vpred: torch.Tensor | None = None  # the learner's prediction before the update, the value head's space

    @property
    def size(self) -> int:
        return int(self.reward.shape[0])

    @property
    def length(self) -> int:
        return int(self.reward.shape[1])

    def select(self, index: torch.Tensor | slice, t: slice = slice(None)) -> Batch:
        def take(x: torch.Tensor) -> torch.Tensor:
            return x[index][:, t]

        def pick(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else take(x)

        return Batch(
            obs={k: v[index][:, t] for k, v in self.obs.items()},
            next_obs={k: v[index] for k, v in self.next_obs.items()},
            action={k: v[index][:, t] for k, v in self.action.items()},
            state={k: v[index] for k, v in self.state.items()},
            reward=take(self.reward), terminated=take(self.terminated), truncated=take(self.truncated),
            first=take(self.first), behaviour_logp=take(self.behaviour_logp),
            behaviour_value=take(self.behaviour_value), bootstrap_value=take(self.bootstrap_value),
            model_version=take(self.model_version),
            advantage=pick(self.advantage), value_target=pick(self.value_target), old_vpred=pick(self.old_vpred))

    def to(self, device: torch.device) -> Batch:
        fields = {f: getattr(self, f) for f in self.__dataclass_fields__}
        moved: dict[str, Any] = {f: to_device(v, device) if isinstance(v, dict) else None if v is None
                                 else v.to(device, non_blocking=True) for f, v in fields.items()}
        return Batch(**moved)


def to_device(tensors: dict[str, torch.Tensor], device: torch.device, rows: slice | None = None,
              start: int | None = None, end: int | None = None) -> dict[str, torch.Tensor]:
    """`tensors[rows, start:end]` on `device` (only that part is copied)."""
    rows = slice(None) if rows is None else rows
    if start is None and end is None:
        return {k: v[rows].to(device, non_blocking=True) for k, v in tensors.items()}
    return {k: v[rows, start:end].to(device, non_blocking=True) for k, v in tensors.items()}


def chains_from_chunks(chunks: list[replay_buffer_pb2.SampledChunk]) -> Batch:
    chains: list[dict[str, np.ndarray]] = []
    for chunk in chunks:
        fragments = [Fragment.from_proto(f) for f in chunk.fragments]
        first, last = fragments[0].data, fragments[-1].data
        chain: dict[str, np.ndarray] = {}
        for key in first:
            if key.startswith("state."):
                chain[key] = first[key]
            elif key.startswith("next_obs."):
                chain[key] = last[key]
            elif len(fragments) == 1:  # one fragment per chunk: its arrays as they are (np.stack copies once)
                chain[key] = first[key]
            else:
                chain[key] = np.concatenate([f.data[key] for f in fragments], axis=0)
        chains.append(chain)

    def stack(key: str) -> torch.Tensor:
        return torch.as_tensor(np.stack([c[key] for c in chains]))

    keys = chains[0].keys()

    def group(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix):]: stack(k) for k in keys if k.startswith(prefix)}

    return Batch(
        obs=group("obs."), next_obs=group("next_obs."), action=group("action."), state=group("state."),
        reward=stack("reward"), terminated=stack("terminated"), truncated=stack("truncated"), first=stack("first"),
        behaviour_logp=stack("logp"), behaviour_value=stack("value"), bootstrap_value=stack("bootstrap_value"),
        model_version=stack("model_version"))
