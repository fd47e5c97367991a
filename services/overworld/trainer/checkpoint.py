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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from overworld.core.blobs import BlobStore, open_blob_store
from overworld.core.config import RunConfig, as_dict, config_hash
from overworld.core.weights import from_bytes, to_bytes

if TYPE_CHECKING:  # the runtime imports this module
    from overworld.trainer.runtime import TrainerRuntime

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


# -- a learner's training state in and out of the store ----------------------------------------------
def rng_states(trainer: TrainerRuntime) -> dict[str, list[torch.Tensor]]:
    """Every rank's RNG state (a collective: every rank calls it), for rank 0 to save."""
    states = {"torch": trainer.all_gather(torch.get_rng_state().to(trainer.device))}
    if trainer.device.type == "cuda":
        states["cuda"] = trainer.all_gather(torch.cuda.get_rng_state(trainer.device).to(trainer.device))
    return {k: [x.cpu() for x in v] for k, v in states.items()}


def save(trainer: TrainerRuntime) -> str:
    """Every rank calls it (the RNG states are gathered); rank 0 writes the full training state,
    atomically (listed only once COMMITTED is written)."""
    rng = rng_states(trainer)
    ckpt_id = checkpoint_id(trainer.iteration)
    trainer.latest_checkpoint = ckpt_id
    if trainer.rank != 0:
        return ckpt_id
    files = {"model.safetensors": to_bytes(trainer.unwrapped_model.state_dict()),
             "optimizer.pt": tensors_to_bytes(trainer.optimizer.state_dict()),
             "rng.pt": tensors_to_bytes(rng)}
    if trainer.scaler is not None:  # MineStudio's scaler.ckpt (overworld export-minestudio writes it from this)
        files["scaler.pt"] = tensors_to_bytes(trainer.scaler.state_dict())
    if trainer.reference is not None:
        files["reference.safetensors"] = to_bytes(trainer.reference.state_dict())
    state = {"iteration": trainer.iteration, "updates": trainer.updates, "samples_trained": trainer.samples_trained,
             "env_steps": trainer.env_steps, "fleet": trainer.fleet, "model_version": trainer.model_version,
             "rho": trainer.rho,
             "world_size": trainer.world_size, "run_id": trainer.config.run_id,
             "config_hash": config_hash(trainer.config), "saved_unix": time.time(), "config": as_dict(trainer.config)}
    trainer.checkpoints.save(trainer.iteration, state, files)
    trainer.checkpoints.prune(trainer.config.train_config.keep_interval, ckpt_id)
    return ckpt_id


def restore_rng(trainer: TrainerRuntime, rng: dict[str, Any]) -> None:
    """This rank's own RNG state. A checkpoint from a smaller world has none for the new ranks:
    they draw a fresh, rank-specific seed (and say so)."""
    states = rng.get("torch")
    if states is None:  # every rng.pt holds it (rng_states)
        raise ValueError("the checkpoint's rng.pt holds no torch RNG state")
    if isinstance(states, torch.Tensor):  # checkpoints written before RNG states were per rank
        states = [states]
    if trainer.rank < len(states):
        torch.set_rng_state(states[trainer.rank])
        if "cuda" in rng and trainer.device.type == "cuda" and trainer.rank < len(rng["cuda"]):
            torch.cuda.set_rng_state(rng["cuda"][trainer.rank], trainer.device)
    else:
        log.warning("rank %d: the checkpoint holds the RNG states of %d ranks; seeding this rank afresh",
                    trainer.rank, len(states))
        torch.manual_seed(trainer.config.seed * 7919 + trainer.rank + 104729 * trainer.iteration)


def _which(trainer: TrainerRuntime, store: CheckpointStore) -> str:
    """What to resume from: `resume` (see TrainConfig.resume), or this run's latest checkpoint for a
    restarted trainer (`continue_run`) that has one."""
    if trainer.continue_run and store.resolve("latest") is not None:
        return "latest"
    return (trainer.config.train_config.resume or "never").strip()


def will_resume(trainer: TrainerRuntime, store: CheckpointStore) -> bool:
    """Whether `restore()` will load a checkpoint (the same rules)."""
    from overworld.trainer.minestudio_checkpoint import is_minestudio_checkpoint

    which = _which(trainer, store)
    if which == "never":
        return False
    return is_minestudio_checkpoint(which) or store.resolve("latest" if which == "auto" else which) is not None


def restore(trainer: TrainerRuntime) -> None:
    """Resume on every rank: model, optimizer, scaler, counters, KL coefficient, RNG, model version."""
    from overworld.trainer.minestudio_checkpoint import import_checkpoint, is_minestudio_checkpoint

    t = trainer.config.train_config
    which = _which(trainer, trainer.checkpoints)
    if which == "never":
        return
    if is_minestudio_checkpoint(which):
        import_checkpoint(which, trainer.unwrapped_model, trainer.optimizer if t.resume_optimizer else None,
                          trainer.scaler if t.resume_optimizer else None)
        trainer.resumed_from = which
        return
    ckpt_id = trainer.checkpoints.resolve("latest" if which == "auto" else which)
    if ckpt_id is None:
        if which == "latest":
            log.warning("resume=latest, but this run has no committed checkpoint yet: starting fresh")
        return
    ckpt = trainer.checkpoints.load(ckpt_id, ["model.safetensors", "optimizer.pt", "rng.pt", "scaler.pt",
                                              "reference.safetensors"])
    model = trainer.unwrapped_model
    model.load_state_dict(from_bytes(ckpt.files["model.safetensors"], model.state_dict()))
    if t.resume_optimizer and "optimizer.pt" in ckpt.files:
        trainer.optimizer.load_state_dict(tensors_from_bytes(ckpt.files["optimizer.pt"]))
    if t.resume_optimizer and "scaler.pt" in ckpt.files and trainer.scaler is not None:
        trainer.scaler.load_state_dict(tensors_from_bytes(ckpt.files["scaler.pt"]))
    if trainer.reference is not None and "reference.safetensors" in ckpt.files:
        trainer.reference.load_state_dict(from_bytes(ckpt.files["reference.safetensors"]))
    s = ckpt.state
    trainer.iteration, trainer.updates = int(s["iteration"]), int(s["updates"])
    if "rng.pt" in ckpt.files:
        restore_rng(trainer, tensors_from_bytes(ckpt.files["rng.pt"]))
    trainer.samples_trained, trainer.env_steps = int(s["samples_trained"]), int(s["env_steps"])
    # the fleet those env steps end in: a trainer restarted in the same run counts the steps its fleet
    # stepped since, those of a new run's fleet all count (a checkpoint without it: a new fleet)
    fleet = s.get("fleet") or {}
    trainer.fleet = {"id": str(fleet.get("id", "")), "env_steps": int(fleet.get("env_steps", 0))}
    trainer.model_version, trainer.rho = int(s["model_version"]), float(s["rho"])
    trainer.resumed_from = ckpt_id
    trainer.latest_checkpoint = ckpt_id
    trainer.start = {"model_version": trainer.model_version, "env_steps": trainer.env_steps, "rho": trainer.rho}
    log.info("rank %d resumed from %s: iteration %d, model version %d, env steps %d, rho %.4g",
             trainer.rank, ckpt_id, trainer.iteration, trainer.model_version, trainer.env_steps, trainer.rho)
