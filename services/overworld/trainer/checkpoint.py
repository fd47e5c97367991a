"""Checkpoints under `train_config.save_path` (`save_location`: the object store, or a directory): `checkpoints/<id>/` holds the model (safetensors), the optimizer
and RNG states (torch tensors, loaded with weights_only=True), and `state.json` (counters, KL
coefficient, model version, config). `COMMITTED` is written last: a checkpoint without it is a
half-written one and is never listed, loaded or kept.

Retention (`save_interval`, `keep_interval`): every `keep_interval`-th iteration's checkpoint is kept
for good, exactly (MineStudio's off-by-one kept the wrong ones); of the others only the newest stays.
"""

from __future__ import annotations

import builtins
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from overworld.core.blobs.store import BlobStore
from overworld.core.blobs.urls import open_blob_store
from overworld.core.config import RunConfig

COMMITTED = "COMMITTED"
log = logging.getLogger("overworld.trainer.checkpoint")
ID_PATTERN = re.compile(r"^iter-(\d{8})$")


def checkpoint_id(iteration: int) -> str:
    return f"iter-{iteration:08d}"


def iteration_of(ckpt_id: str) -> int:
    match = ID_PATTERN.match(ckpt_id)
    if not match:
        raise ValueError(f"{ckpt_id!r} is not a checkpoint id (iter-NNNNNNNN)")
    return int(match.group(1))


def tensors_to_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def tensors_from_bytes(data: bytes) -> Any:
    # weights_only: optimizer and RNG states are tensors and plain containers; nothing executable.
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


@dataclass
class Checkpoint:
    ckpt_id: str
    state: dict[str, Any]
    files: dict[str, bytes]


class CheckpointStore:
    def __init__(self, blobs: BlobStore, prefix: str = "checkpoints") -> None:
        self.blobs = blobs
        self.prefix = prefix.rstrip("/")

    def _key(self, ckpt_id: str, name: str) -> str:
        return f"{self.prefix}/{ckpt_id}/{name}"

    def save(self, iteration: int, state: dict[str, Any], files: dict[str, bytes]) -> str:
        ckpt_id = checkpoint_id(iteration)
        for name, data in files.items():
            self.blobs.put(self._key(ckpt_id, name), data)
        self.blobs.put(self._key(ckpt_id, "state.json"), json.dumps(state, indent=1).encode())
        self.blobs.put(self._key(ckpt_id, COMMITTED), b"")
        return ckpt_id

    def update_state(self, ckpt_id: str, **changes: Any) -> None:
        """A committed checkpoint's state.json with `changes` (one put: the old or the new one is read)."""
        key = self._key(ckpt_id, "state.json")
        state = json.loads(self.blobs.get(key))
        self.blobs.put(key, json.dumps({**state, **changes}, indent=1).encode())

    def list(self) -> list[str]:
        """Committed checkpoint ids, oldest first."""
        ids = set()
        for key in self.blobs.keys(self.prefix + "/"):
            parts = key[len(self.prefix) + 1:].split("/")
            if len(parts) == 2 and parts[1] == COMMITTED and ID_PATTERN.match(parts[0]):
                ids.add(parts[0])
        return sorted(ids, key=iteration_of)

    def resolve(self, which: str) -> str | None:
        ids = self.list()
        if which == "latest":
            return ids[-1] if ids else None
        if which not in ids:
            raise ValueError(f"checkpoint {which!r} does not exist; committed checkpoints: {ids[-10:] or 'none'}")
        return which

    # builtins.list from here on: inside the class, `list` is the method above
    def load(self, ckpt_id: str, names: builtins.list[str]) -> Checkpoint:
        state = json.loads(self.blobs.get(self._key(ckpt_id, "state.json")))
        files = {}
        for name in names:
            try:
                files[name] = self.blobs.get(self._key(ckpt_id, name))
            except (FileNotFoundError, KeyError):
                continue
        return Checkpoint(ckpt_id, state, files)

    def prune(self, keep_interval: int, newest: str) -> builtins.list[str]:
        """Delete every checkpoint that is neither a keep_interval-th one nor the newest."""
        removed = []
        for ckpt_id in self.list():
            iteration = iteration_of(ckpt_id)
            if ckpt_id == newest or (keep_interval > 0 and iteration % keep_interval == 0):
                continue
            self.delete(ckpt_id)
            removed.append(ckpt_id)
        return removed

    def delete(self, ckpt_id: str) -> None:
        keys = [k for k in self.blobs.keys(f"{self.prefix}/{ckpt_id}/")]
        marker = self._key(ckpt_id, COMMITTED)
        # Uncommit first, so a crash halfway through never leaves a listed, partial checkpoint.
        self.blobs.delete([marker])
        self.blobs.delete([k for k in keys if k != marker])


def save_location(config: RunConfig, workdir: str) -> str:
    """`train_config.save_path`: s3://BUCKET/PREFIX, an absolute directory, or one relative to the workdir
    (null: the default, `output`)."""
    path = config.train_config.save_path or "output"
    return path if path.startswith("s3://") or Path(path).is_absolute() else str(Path(workdir) / path)


def is_durable(config: RunConfig) -> bool:
    """Whether `save_path` is outside the workdir (an object store, a mounted volume), so that the
    trainer's logs must be copied there too: in a pod the workdir dies with it."""
    path = config.train_config.save_path or "output"
    return path.startswith("s3://") or Path(path).is_absolute()


def checkpoint_store(config: RunConfig, workdir: str) -> CheckpointStore:
    return CheckpointStore(open_blob_store(save_location(config, workdir)),
                           prefix=f"{config.run_id or 'run'}/checkpoints")
