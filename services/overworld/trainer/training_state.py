"""A learner's training state in and out of the checkpoint store (checkpoint.py): what `save` writes of
it, and what `restore` sets again on every rank. `TrainingState` names each part of the learner that
a checkpoint holds or needs (the runtime, trainer/runtime.py, has them all)."""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Protocol, TypedDict

import grpc
import torch

from overworld.core.blobs.store import UNREACHABLE
from overworld.core.config import RunConfig, as_dict, config_hash
from overworld.core.wire.weights import from_bytes, to_bytes
from overworld.policies.base import Policy
from overworld.trainer.checkpoint import CheckpointStore, checkpoint_id, tensors_from_bytes, tensors_to_bytes
from overworld.trainer.minestudio_checkpoint import import_checkpoint, is_minestudio_checkpoint

log = logging.getLogger("overworld.trainer.checkpoint")

# A checkpoint's writes wait out an object store that cannot be reached this long (its pod restarting).
WRITE_RETRY_SECONDS = 120.0


class StartPoint(TypedDict):
    """Where this trainer's run (re)started: a checkpoint's model version, env steps and rho (or zeros)."""
    model_version: int
    env_steps: int
    rho: float


class FleetMark(TypedDict):
    """Which fleet's steps `env_steps` includes, and how many of them (FleetStatus.fleet_id, .env_steps)."""
    id: str
    env_steps: int


class TrainingState(Protocol):
    config: RunConfig
    continue_run: bool  # a restarted trainer: this run's latest checkpoint comes first
    checkpoints: CheckpointStore
    rank: int
    world_size: int
    device: torch.device
    # saved and restored
    optimizer: Any
    lr_schedule: Any
    scaler: torch.amp.GradScaler | None
    reference: Policy | None
    iteration: int
    updates: int
    samples_trained: int
    env_steps: int
    fleet: FleetMark
    model_version: int
    rho: float
    # set by restore
    start: StartPoint
    resumed_from: str | None
    latest_checkpoint: str

    @property
    def unwrapped_model(self) -> Policy: ...

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]: ...


def rng_states(trainer: TrainingState) -> dict[str, list[torch.Tensor]]:
    """Every rank's RNG state (a collective: every rank calls it), for rank 0 to save."""
    states = {"torch": trainer.all_gather(torch.get_rng_state().to(trainer.device))}
    if trainer.device.type == "cuda":
        states["cuda"] = trainer.all_gather(torch.cuda.get_rng_state(trainer.device).to(trainer.device))
    return {k: [x.cpu() for x in v] for k, v in states.items()}


def save(trainer: TrainingState) -> str:
    """Every rank calls it (the RNG states are gathered); rank 0 writes the full training state,
    atomically (listed only once COMMITTED is written)."""
    rng = rng_states(trainer)
    ckpt_id = checkpoint_id(trainer.iteration)
    trainer.latest_checkpoint = ckpt_id
    if trainer.rank != 0:
        return ckpt_id
    files = {"model.safetensors": to_bytes(trainer.unwrapped_model.state_dict()),
             "optimizer.pt": tensors_to_bytes(trainer.optimizer.state_dict()),
             "lr_schedule.pt": tensors_to_bytes(trainer.lr_schedule.state_dict()),
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
    write_checkpoint(trainer.checkpoints, trainer.iteration, state, files)
    trainer.checkpoints.prune(trainer.config.train_config.keep_interval, ckpt_id)
    return ckpt_id


def write_checkpoint(store: CheckpointStore, iteration: int, state: dict[str, Any], files: dict[str, bytes]) -> None:
    """`store.save`, waiting out an object store that cannot be reached (a restarting pod) for up to
    WRITE_RETRY_SECONDS: a checkpoint is worth the wait, and a trainer that fails here costs a restart."""
    deadline = time.monotonic() + WRITE_RETRY_SECONDS
    delay = 1.0
    while True:
        try:
            store.save(iteration, state, files)
            return
        except UNREACHABLE as err:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("checkpoint %s: the store cannot be reached (%s); writing it again in %.0fs",
                        checkpoint_id(iteration), err, delay)
            time.sleep(delay)
            delay = min(2 * delay, 10.0)


def fast_forward(schedule: Any, iterations: int) -> None:
    """`schedule` as it is after `iterations` steps, and its optimizer's learning rates with it."""
    schedule.last_epoch = iterations - 1
    with warnings.catch_warnings():  # step() outside an optimizer step: that is the point here
        warnings.simplefilter("ignore", UserWarning)
        schedule.step()


def restore_rng(trainer: TrainingState, rng: dict[str, Any]) -> None:
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


def _which(trainer: TrainingState, store: CheckpointStore) -> str:
    """What to resume from: `resume` (see TrainConfig.resume), or this run's latest checkpoint for a
    restarted trainer (`continue_run`) that has one."""
    if trainer.continue_run and store.resolve("latest") is not None:
        return "latest"
    return (trainer.config.train_config.resume or "never").strip()


def will_resume(trainer: TrainingState, store: CheckpointStore) -> bool:
    """Whether `restore()` will load a checkpoint (the same rules)."""
    which = _which(trainer, store)
    if which == "never":
        return False
    return is_minestudio_checkpoint(which) or store.resolve("latest" if which == "auto" else which) is not None


def restore(trainer: TrainingState) -> None:
    """Resume on every rank: model, optimizer, scaler, counters, KL coefficient, RNG, model version."""
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
    ckpt = trainer.checkpoints.load(ckpt_id, ["model.safetensors", "optimizer.pt", "lr_schedule.pt", "rng.pt",
                                              "scaler.pt", "reference.safetensors"])
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
    if t.resume_optimizer and "lr_schedule.pt" in ckpt.files:
        trainer.lr_schedule.load_state_dict(tensors_from_bytes(ckpt.files["lr_schedule.pt"]))
    else:  # a checkpoint written before schedules were saved, or a fresh optimizer: where the schedule is now
        fast_forward(trainer.lr_schedule, trainer.iteration)
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


def count_env_steps(trainer: TrainingState, asked: grpc.Future | None) -> int:
    """Adds the env steps the fleet stepped since they were last counted (in this process or before
    the checkpoint it resumed from) to `env_steps`; returns how many. `asked`: the rollout-manager's
    FleetStatus, asked while the iteration ran. The fleet counts from zero, and a new fleet (a new
    `overworld run`) under a new id: all its steps are new. Nothing while the manager is away: its
    steps are counted once, when it answers again."""
    try:
        status = asked.result() if asked is not None else None
    except Exception:  # statistics only: never stall training on the manager
        return 0
    if status is None:
        return 0
    counted = trainer.fleet["env_steps"] if status.fleet_id == trainer.fleet["id"] else 0
    new_steps = max(0, int(status.env_steps) - counted)
    trainer.env_steps += new_steps
    trainer.fleet = {"id": status.fleet_id, "env_steps": counted + new_steps}
    return new_steps
