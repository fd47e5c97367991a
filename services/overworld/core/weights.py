"""Model weights as safetensors bytes (the registry's payload), optionally in half precision."""

from __future__ import annotations

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def to_bytes(state_dict: dict[str, torch.Tensor], half: bool = False) -> bytes:
    out = {}
    for k, v in state_dict.items():
        v = v.detach().to("cpu").contiguous()
        if half and v.is_floating_point():
            v = v.to(torch.bfloat16)
        out[k] = v
    return st_save(out)


def from_bytes(data: bytes, like: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    tensors = st_load(data)
    if like is not None:
        tensors = {k: v.to(like[k].dtype) if k in like else v for k, v in tensors.items()}
    return tensors
