"""Per-slot arrays in shared memory: observations, actions and step outcomes of every env slot.

The worker (parent) creates the blocks; each env process attaches to them by name. A row belongs
to one slot; who may write it at a given moment is fixed by the step protocol (see env_pool.py),
so there is no lock and nothing is ever pickled.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np

from overworld.core.specs import Spaces, TensorSpec


def layout(spaces: Spaces) -> dict[str, TensorSpec]:
    """obs.<k> (current observation), final_obs.<k> (last observation of an ended episode),
    action.<k>, reward, terminated, truncated, and act (the parent asks this slot to step)."""
    out: dict[str, TensorSpec] = {}
    for k, s in spaces.obs.items():
        out[f"obs.{k}"] = s
        out[f"final_obs.{k}"] = s
    for k, s in spaces.action.items():
        out[f"action.{k}"] = s
    out["reward"] = TensorSpec((), "float32")
    out["terminated"] = TensorSpec((), "bool")
    out["truncated"] = TensorSpec((), "bool")
    out["act"] = TensorSpec((), "bool")
    return out


class SharedArrays:
    """One shared-memory block per key, viewed as an (num_envs, ...) array."""

    def __init__(self, spec: dict[str, TensorSpec], num_envs: int, names: dict[str, str] | None = None) -> None:
        self.blocks: dict[str, shared_memory.SharedMemory] = {}
        self.arrays: dict[str, np.ndarray] = {}
        for key, s in spec.items():
            shape = (num_envs, *s.shape)
            nbytes = max(1, int(np.prod(shape)) * np.dtype(s.dtype).itemsize)
            if names is None:
                block = shared_memory.SharedMemory(create=True, size=nbytes)
            else:
                block = shared_memory.SharedMemory(name=names[key])
            self.blocks[key] = block
            self.arrays[key] = np.ndarray(shape, dtype=s.dtype, buffer=block.buf)
            if names is None:
                self.arrays[key].fill(0)

    @property
    def names(self) -> dict[str, str]:
        return {k: b.name for k, b in self.blocks.items()}

    def close(self, unlink: bool) -> None:
        self.arrays.clear()
        for block in self.blocks.values():
            block.close()
            if unlink:
                block.unlink()


def local_arrays(spec: dict[str, TensorSpec], num_envs: int) -> dict[str, np.ndarray]:
    """The same layout in ordinary memory (the in-process backend)."""
    return {k: np.zeros((num_envs, *s.shape), s.dtype) for k, s in spec.items()}
