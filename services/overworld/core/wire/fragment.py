"""The fragment: `length` consecutive steps of one environment slot, and its wire codec.

Tensors (T = length):
  obs.<k> (T, ...), next_obs.<k> (1, ...)   observations before each step, and after the last
  action.<k> (T, ...)                        actions taken
  state.<k> (...)                            recurrent state before step 0 (feed-forward: none)
  reward f32 (T,)                            reward after step t
  terminated, truncated bool (T,)            the episode ended after step t (truncated: by a time limit)
  first bool (T,)                            step t starts an episode
  logp f32 (T,)                              behaviour policy's log-prob of the action
  value f32 (T,)                             behaviour policy's value estimate
  bootstrap_value f32 (T,)                   value of the final observation where truncated, else 0
  model_version i64 (T,)                     model version that chose the action
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from overworld.core.specs import Spaces
from overworld.core.wire import tensors
from overworld.v1 import common_pb2

STEP_FIELDS: dict[str, str] = {
    "reward": "float32",
    "terminated": "bool",
    "truncated": "bool",
    "first": "bool",
    "logp": "float32",
    "value": "float32",
    "bootstrap_value": "float32",
    "model_version": "int64",
}


class FragmentError(ValueError):
    """A fragment that does not match the run's spaces; the message says what is wrong."""


@dataclass
class Fragment:
    run_id: str
    worker_id: str
    env_slot: int
    sequence: int
    data: dict[str, np.ndarray]

    @property
    def length(self) -> int:
        return int(self.data["reward"].shape[0])

    @property
    def slot_key(self) -> str:
        return f"{self.worker_id}/{self.env_slot}"

    def to_proto(self, compression: common_pb2.Compression = common_pb2.COMPRESSION_NONE) -> common_pb2.Fragment:
        header = common_pb2.FragmentHeader(
            run_id=self.run_id,
            worker_id=self.worker_id,
            env_slot=self.env_slot,
            sequence=self.sequence,
            length=self.length,
            first_model_version=int(self.data["model_version"][0]),
            compression=compression,
        )
        return common_pb2.Fragment(header=header, tensors=tensors.encode(self.data, compression))

    @staticmethod
    def from_proto(msg: common_pb2.Fragment, max_bytes: int | None = None) -> Fragment:
        h = msg.header
        data = tensors.decode(msg.tensors, h.compression, max_bytes)
        return Fragment(h.run_id, h.worker_id, h.env_slot, h.sequence, data)


def expected_tensors(spaces: Spaces, length: int) -> dict[str, tuple[tuple[int, ...], str]]:
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for k, s in spaces.obs.items():
        out[f"obs.{k}"] = ((length, *s.shape), s.dtype)
        out[f"next_obs.{k}"] = ((1, *s.shape), s.dtype)
    for k, s in spaces.action.items():
        out[f"action.{k}"] = ((length, *s.shape), s.dtype)
    for k, s in spaces.state.items():
        out[f"state.{k}"] = (s.shape, s.dtype)
    for k, dtype in STEP_FIELDS.items():
        out[k] = ((length,), dtype)
    return out


def validate(fragment: Fragment, spaces: Spaces, length: int, run_id: str | None = None) -> None:
    """Raise FragmentError unless the fragment has exactly the declared tensors, all finite."""
    if run_id is not None and fragment.run_id != run_id:
        raise FragmentError(f"fragment belongs to run {fragment.run_id!r}, this buffer serves run {run_id!r}")
    expected = expected_tensors(spaces, length)
    got = set(fragment.data)
    if missing := sorted(set(expected) - got):
        raise FragmentError(f"missing tensors: {', '.join(missing)}")
    if extra := sorted(got - set(expected)):
        raise FragmentError(f"unexpected tensors: {', '.join(extra)}")
    for name, (shape, dtype) in expected.items():
        array = fragment.data[name]
        if array.dtype != np.dtype(dtype):
            raise FragmentError(f"{name}: dtype {array.dtype}, expected {dtype}")
        if array.shape != shape:
            raise FragmentError(f"{name}: shape {tuple(array.shape)}, expected {shape}")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise FragmentError(f"{name}: contains NaN or infinity")
    versions = fragment.data["model_version"]
    if (versions < 0).any() or (np.diff(versions) < 0).any():
        raise FragmentError("model_version: must be non-negative and non-decreasing within a fragment")
