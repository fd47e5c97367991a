"""BaseTrainer with MineStudio's API, run by Ray Train's TorchTrainer (DDP: gloo on CPU, NCCL on GPU), or
with `train_config.num_workers: 0` as one learner in the driver's process, without Ray (local mode).

`fit()` runs on the trainer driver: it places the workers (trainer/placement.py: GPUs follow
`num_gpus_per_worker` and the cluster, never the driver's own hardware) and starts Ray Train.
`_train_func()` runs in every Ray Train worker: it builds the model and optimizer, restores a
checkpoint if there is one, and calls `train()`: fetch chunks from the replay buffer, recompute
values and log-probs in bounded chunks, estimate advantages with the gae service, update, and
(rank 0) publish the new version to the model registry. Everything around the update is a hook
(trainer/hooks.py).

Memory: an iteration's batch stays in host memory; only `inference_batch_size_per_gpu` chains x
`context_length` steps (recomputation) or one minibatch (update) are on the device at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from overworld.core.config import (
    RunConfig,
    TrainConfig,
    as_dict,
    config_hash,
    from_yaml,
    learner_ranks,
    load_config,
    to_yaml,
)
from overworld.core.grpc_util import channel, retry
from overworld.core.weights import from_bytes, to_bytes
from overworld.gae.client import GaeClient
from overworld.model_registry.client import ModelRegistryClient
from overworld.policies.base import Policy
from overworld.policies.factory import run_spaces
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.trainer.checkpoint import checkpoint_id, checkpoint_store, tensors_from_bytes, tensors_to_bytes
from overworld.trainer.data import Batch, chains_from_chunks, to_device
from overworld.trainer.hooks import Hooks
from overworld.trainer.placement import (
    local_mode_device,
    require_usable_cuda,
    reserve_workers,
    torch_trainer_class,
    worker_resources,
)
from overworld.trainer.prefetch import ChunkReader
from overworld.v1 import (
    replay_buffer_pb2,
    replay_buffer_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

log = logging.getLogger("overworld.trainer")


def _callable(ref: str) -> Any:
    """A generator given by import path, called where it is needed (imported on first call)."""
    from overworld.core.imports import import_object

    def generator(*args: Any, **kwargs: Any) -> Any:
        return import_object(ref)(*args, **kwargs)

    generator.__qualname__ = generator.__name__ = ref.rsplit(":", 1)[-1]
    return generator


def _config_with(config: RunConfig | None, policy_generator: Any, env_generator: Any,
                 train: dict[str, Any]) -> RunConfig:
    """`config` (or the defaults) with MineStudio's constructor arguments applied: they are never dropped."""
    from overworld.online.generators import generator_ref

    data = as_dict(config) if config is not None else {}
    data.setdefault("train_config", {}).update(train)
    for key, value in (("policy_generator", policy_generator), ("env_generator", env_generator)):
        if value is not None:
            data[key] = generator_ref(value, key)
    merged = load_config(data)
    if config is not None:
        merged.run_id = config.run_id
    return merged


class BaseTrainer:
    """MineStudio's BaseTrainer: constructed with MineStudio's arguments (the generators as callables
    or import paths, train_config's keys as keyword arguments, `whole_config`), or from a RunConfig
    (`config=`, what the services use). Keyword arguments that are train_config keys win over `config`.
    MineStudio's attribute names (`inner_model`, `ref_model`, `kl_divergence_coef_rho`, `num_updates`,
    `fragments_per_iteration`, and every train_config key) read Overworld's state."""

    def __init__(self, rollout_manager: str = "", policy_generator: Any = None, env_generator: Any = None,
                 num_workers: int | None = None, num_readers: int | None = None,
                 num_cpus_per_reader: float | None = None, num_gpus_per_worker: float | None = None,
                 prefetch_batches: int | None = None, discount: float | None = None, gae_lambda: float | None = None,
                 context_length: int | None = None, use_normalized_vf: bool | None = None,
                 inference_batch_size_per_gpu: int | None = None, use_amp: bool | None = None,
                 resume: str | None = None, resume_optimizer: bool | None = None, *, config: RunConfig | None = None,
                 replay_buffer: str = "",
                 gae: str = "", model_registry: str = "", status_address: str = "", workdir: str = ".",
                 whole_config: str | None = None, **kwargs: Any) -> None:
        given = {"num_workers": num_workers, "num_readers": num_readers, "num_cpus_per_reader": num_cpus_per_reader,
                 "num_gpus_per_worker": num_gpus_per_worker, "prefetch_batches": prefetch_batches,
                 "discount": discount, "gae_lambda": gae_lambda, "context_length": context_length,
                 "use_normalized_vf": use_normalized_vf, "inference_batch_size_per_gpu": inference_batch_size_per_gpu,
                 "use_amp": use_amp, "resume": resume, "resume_optimizer": resume_optimizer}
        train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
        given = {k: v for k, v in given.items() if v is not None or (k == "resume" and config is None)}
        given.update({k: kwargs.pop(k) for k in list(kwargs) if k in train_keys})
        kwargs.pop("enable_ref_update", None)  # MineStudio stores it and never reads it (core/config.py)
        config = _config_with(config, policy_generator, env_generator, given)
        t = config.train_config
        self.rollout_manager = rollout_manager
        self.policy_generator = _callable(config.policy_generator) if not callable(policy_generator) else policy_generator
        self.env_generator = _callable(config.env_generator) if not callable(env_generator) else env_generator
        self.num_workers = t.num_workers
        self.num_readers = t.num_readers
        self.num_cpus_per_reader = t.num_cpus_per_reader
        self.num_gpus_per_worker = t.num_gpus_per_worker
        self.prefetch_batches = t.prefetch_batches
        self.discount = t.discount
        self.gae_lambda = t.gae_lambda
        self.context_length = t.context_length
        self.use_normalized_vf = t.use_normalized_vf
        self.inference_batch_size_per_gpu = t.inference_batch_size_per_gpu or t.batch_size_per_gpu
        self.use_amp = t.use_amp
        self.resume = t.resume
        self.resume_optimizer = t.resume_optimizer
        self.whole_config = whole_config
        self.config = config
        self.replay_buffer = replay_buffer
        self.gae = gae
        self.model_registry = model_registry
        self.status_address = status_address
        self.workdir = workdir
        self.extra = kwargs
        self.hooks = Hooks()
        # Training state, set up in each Ray Train worker and saved in every checkpoint.
        self.rank = 0
        self.world_size = 1
        self.device = torch.device("cpu")
        self.model_version = 0
        self.iteration = 0
        self.updates = 0
        self.samples_trained = 0
        self.env_steps = 0
        self.rho = t.kl_divergence_coef_rho
        self.resumed_from: str | None = None
        self.start = {"model_version": 0, "env_steps": 0, "rho": self.rho}
        self.latest_checkpoint = ""
        self.timings: dict[str, float] = {}  # seconds of each part of the last iteration (trainer/*_seconds)
        # How long fit() waits for the cluster to offer the workers' resources (train_config.
        # placement_timeout); the driver sets 0 for a Ray it started itself: that cluster cannot grow.
        self.placement_timeout = config.train_config.placement_timeout
        self.own_ray = False  # the driver started this Ray itself (see placement.torch_trainer_class)
        self.amp_dtype: torch.dtype | None = None  # set with the optimizer (trainer/ppo.py amp_settings)
        self.scaler: torch.amp.GradScaler | None = None  # fp16 only; saved in every checkpoint (scaler.pt)

    @classmethod
    def from_config(cls, config: RunConfig, **addresses: Any) -> BaseTrainer:
        return cls(addresses.pop("rollout_manager"), config=config, **addresses)

    # -- MineStudio's names for Overworld's state ------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        config = self.__dict__.get("config")
        if config is not None and name in TrainConfig.__dataclass_fields__:
            return getattr(config.train_config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def kl_divergence_coef_rho(self) -> float:
        return self.rho

    @kl_divergence_coef_rho.setter
    def kl_divergence_coef_rho(self, value: float) -> None:
        self.rho = value

    @property
    def num_updates(self) -> int:
        """MineStudio's count of finished ppo_update calls: Overworld's iteration (read-only: the loop counts)."""
        return self.iteration

    @property
    def inner_model(self) -> Policy:
        return self.unwrapped_model

    @property
    def ref_model(self) -> Policy | None:
        return self.__dict__.get("reference")

    @property
    def fragments_per_iteration(self) -> int:
        """Chunks of one iteration, all ranks (MineStudio's num_workers x batch_size_per_gpu x batches_per_iteration)."""
        t = self.config.train_config
        return learner_ranks(t) * t.batch_size_per_gpu * t.batches_per_iteration

    # -- collectives over this trainer's ranks (no-ops for one rank) ------------------------------
    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.distributed:
            x = x.clone()
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape on each), in rank order."""
        if not self.distributed:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x)
        return parts

    # -- MineStudio's API --------------------------------------------------------------------
    def setup_model_and_optimizer(self, policy_generator: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Build (model, optimizer). MineStudio's subclasses build the model with `policy_generator()`;
        a MinePolicy they return is wrapped as an overworld Policy (same parameters) by the caller."""
        raise NotImplementedError

    def train(self) -> None:
        raise NotImplementedError

    def train_iteration(self, batch: Batch | None = None) -> dict[str, float] | None:
        raise NotImplementedError

    def fit(self) -> None:
        """Place `num_workers` Ray Train workers and run `_train_func` on each (the caller has done
        ray.init). A worker gets a GPU exactly when `num_gpus_per_worker > 0`; a cluster without
        them fails here, with how many were asked and how many the cluster has. `num_workers: 0` is
        local mode (what Ray Train's local mode did, without Ray): the learner is built from the
        config and `_train_func` runs here, in this thread, and Ray is never imported, so that a
        machine without Ray trains (on this machine's GPU exactly when `num_gpus_per_worker > 0`)."""
        from overworld.online.generators import generator_ref

        t = self.config.train_config
        loop_config = {
            "trainer_class": generator_ref(type(self), "trainer_name"),  # a class from a user's file: by its path
            "config_yaml": to_yaml(self.config),
            "addresses": {"rollout_manager": self.rollout_manager, "replay_buffer": self.replay_buffer,
                          "gae": self.gae, "model_registry": self.model_registry,
                          "status_address": self.status_address, "workdir": self.workdir,
                          **({"continue_run": True} if self.extra.get("continue_run") else {})},
        }
        if not t.num_workers:  # local mode: the learner in this process; no Ray, nothing to place
            local_mode_device(t.num_gpus_per_worker)  # a GPU asked for and not usable here ends it now
            _train_loop(loop_config)
            return
        from ray.train import RunConfig as RayRunConfig
        from ray.train import ScalingConfig

        resources = worker_resources(t.num_gpus_per_worker)
        reserve_workers(t.num_workers, resources, self.placement_timeout)
        trainer = torch_trainer_class(self.own_ray)(
            train_loop_per_worker=_train_loop, train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=t.num_workers, use_gpu="GPU" in resources,
                                         resources_per_worker=resources),
            run_config=RayRunConfig(name=f"overworld-{self.config.run_id}",
                                    storage_path=str(Path(self.workdir, "ray").resolve())))
        trainer.fit()

    def broadcast_model_to_rollout_workers(self, new_version: bool) -> None:
        """MineStudio's: with `new_version`, publish the current weights as the next model version;
        workers watching the registry swap them in. Rank 0 only. Versions are immutable in the registry,
        so `new_version=False` (re-send the current version) has nothing to publish."""
        if self.rank != 0 or not new_version:
            return
        started = time.monotonic()
        version = self.model_version + 1
        data = to_bytes(self.unwrapped_model.state_dict())
        counters = {"iteration": self.iteration, "updates": self.updates, "samples_trained": self.samples_trained,
                    "env_steps": self.env_steps}
        self.registry.publish(version, data, parent=self.model_version, counters=counters,
                              config_hash=config_hash(self.config))
        self.model_version = version
        retry(lambda: self.buffer.SetModelVersion(
            replay_buffer_pb2.SetModelVersionRequest(model_version=version), timeout=30), "SetModelVersion", 60)
        self.timings["publish"] = time.monotonic() - started

    def fetch_fragments_and_estimate_advantages(self, *, num_fragments: int | None = None) -> dict[str, Any]:
        """MineStudio's: this rank's share of `num_fragments` (default: fragments_per_iteration) with
        advantages. Returns MineStudio's keys: `records` (this rank's Batch of chains), `td_targets`,
        `advantages`, `old_logps` (the behaviour policy's, recorded at rollout), `old_vpreds` (B, L)
        tensors aligned with it, `rewards` (B,) summed per chain, and `old_pi_logits` (None: the
        update recomputes what it needs). Everything stays in host memory."""
        if num_fragments is not None and num_fragments != self.fragments_per_iteration:
            raise ValueError(f"num_fragments={num_fragments}: this trainer reads {self.fragments_per_iteration} per "
                             "iteration (num_workers x batch_size_per_gpu x batches_per_iteration); change those")
        started = time.monotonic()
        batch = chains_from_chunks(self.reader.next())
        self.timings["sample"] = time.monotonic() - started
        batch = self.estimate_advantages(batch)
        return {"records": batch, "rewards": batch.reward.sum(1), "td_targets": batch.value_target,
                "advantages": batch.advantage, "old_logps": batch.behaviour_logp, "old_pi_logits": None,
                "old_vpreds": batch.old_vpred}

    def estimate_advantages(self, batch: Batch) -> Batch:
        """Fills in the batch's advantages and value targets (the gae service; V-trace if configured)
        and the learner's value predictions before the update."""
        t = self.config.train_config
        started = time.monotonic()
        vpred, next_vpred, target_logp = self.compute_values(batch)
        normalizer = self.unwrapped_model.value_normalizer
        # Denormalised with the statistics the predictions were made with, before this batch moves them.
        value, next_value = normalizer.denormalize(vpred.to(self.device)), normalizer.denormalize(next_vpred.to(self.device))
        request = {
            "reward": batch.reward.numpy(), "value": value.float().cpu().numpy(),
            "terminated": batch.terminated.numpy(), "truncated": batch.truncated.numpy(),
            "bootstrap_value": batch.bootstrap_value.numpy(), "next_value": next_value.float().cpu().numpy()}
        if t.vtrace:
            request["behaviour_logp"] = batch.behaviour_logp.numpy()
            request["target_logp"] = target_logp.numpy()
        valued = time.monotonic()
        adv, target = self.gae_client.estimate(request, self.discount, self.gae_lambda, vtrace=t.vtrace,
                                               rho_clip=t.vtrace_rho_clip, c_clip=t.vtrace_c_clip)
        self.timings.update(values=valued - started, gae=time.monotonic() - valued)
        batch.advantage = torch.as_tensor(adv)
        batch.value_target = torch.as_tensor(target)
        batch.old_vpred = vpred
        return batch

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The learner's value predictions (B, L) in the value head's space, its prediction for the
        observation after the last step (B,), and its log-probs of the behaviour actions (B, L); on
        the host, float32.

        Bounded memory: `inference_batch_size_per_gpu` chains at a time go through the model in
        windows of `context_length` steps, each group from its recorded state with the recurrent
        state carried from window to window (so the values are those of one pass over the chain)."""
        from overworld.policies.base import log_prob

        model = self.unwrapped_model
        B, L = batch.size, batch.length
        group, window = max(1, self.inference_batch_size_per_gpu), min(self.context_length, L)
        vpred, logp, next_vpred = torch.empty(B, L), torch.empty(B, L), torch.empty(B)
        last_done = batch.terminated[:, -1:] | batch.truncated[:, -1:]
        for b0 in range(0, B, group):
            rows = slice(b0, min(b0 + group, B))
            state = to_device(batch.state, self.device, rows)
            for start in range(0, L, window):
                end = min(start + window, L)
                obs = {k: v[rows, start:end] for k, v in batch.obs.items()}
                first = batch.first[rows, start:end]
                if end == L:  # the step after the chain rides along with the last window
                    obs = {k: torch.cat([v, batch.next_obs[k][rows]], 1) for k, v in obs.items()}
                    first = torch.cat([first, last_done[rows]], 1)
                with self.autocast():
                    out, state = model(to_device(obs, self.device), state, first.to(self.device))
                n = end - start
                vpred[rows, start:end] = out.vpred[:, :n].float().cpu()
                logits = {k: v[:, :n].float() for k, v in out.logits.items()}
                logp[rows, start:end] = log_prob(logits, to_device(batch.action, self.device, rows, start, end)).cpu()
                if end == L:
                    next_vpred[rows] = out.vpred[:, -1].float().cpu()
        return vpred, next_vpred, logp

    def autocast(self) -> contextlib.AbstractContextManager:
        """`use_amp`: autocast to `amp_dtype` around the learner's forward passes (the update's, as MineStudio,
        and the value recomputation before GAE, which MineStudio runs in fp32); a no-op without it."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    # -- checkpoints -----------------------------------------------------------------------------
    def rng_states(self) -> dict[str, list[torch.Tensor]]:
        """Every rank's RNG state (a collective: every rank calls it), for rank 0 to save."""
        states = {"torch": self.all_gather(torch.get_rng_state().to(self.device))}
        if self.device.type == "cuda":
            states["cuda"] = self.all_gather(torch.cuda.get_rng_state(self.device).to(self.device))
        return {k: [x.cpu() for x in v] for k, v in states.items()}

    def save_checkpoint(self) -> str:
        """Every rank calls it (the RNG states are gathered); rank 0 writes the full training state,
        atomically (listed only once COMMITTED is written)."""
        rng = self.rng_states()
        ckpt_id = checkpoint_id(self.iteration)
        self.latest_checkpoint = ckpt_id
        if self.rank != 0:
            return ckpt_id
        files = {"model.safetensors": to_bytes(self.unwrapped_model.state_dict()),
                 "optimizer.pt": tensors_to_bytes(self.optimizer.state_dict()),
                 "rng.pt": tensors_to_bytes(rng)}
        if self.scaler is not None:  # MineStudio's scaler.ckpt (overworld export-minestudio writes it from this)
            files["scaler.pt"] = tensors_to_bytes(self.scaler.state_dict())
        if getattr(self, "reference", None) is not None:
            files["reference.safetensors"] = to_bytes(self.reference.state_dict())  # type: ignore[union-attr]
        state = {"iteration": self.iteration, "updates": self.updates, "samples_trained": self.samples_trained,
                 "env_steps": self.env_steps, "model_version": self.model_version, "rho": self.rho,
                 "world_size": self.world_size, "run_id": self.config.run_id,
                 "config_hash": config_hash(self.config), "saved_unix": time.time(), "config": as_dict(self.config)}
        self.checkpoints.save(self.iteration, state, files)
        self.checkpoints.prune(self.config.train_config.keep_interval, ckpt_id)
        return ckpt_id

    def restore_rng(self, rng: dict[str, Any]) -> None:
        """This rank's own RNG state. A checkpoint from a smaller world has none for the new ranks:
        they draw a fresh, rank-specific seed (and say so)."""
        states = rng.get("torch")
        if isinstance(states, torch.Tensor):  # checkpoints written before RNG states were per rank
            states = [states]
        if self.rank < len(states):
            torch.set_rng_state(states[self.rank])
            if "cuda" in rng and self.device.type == "cuda" and self.rank < len(rng["cuda"]):
                torch.cuda.set_rng_state(rng["cuda"][self.rank], self.device)
        else:
            log.warning("rank %d: the checkpoint holds the RNG states of %d ranks; seeding this rank afresh",
                        self.rank, len(states))
            torch.manual_seed(self.config.seed * 7919 + self.rank + 104729 * self.iteration)

    def restore(self) -> None:
        """Resume on every rank: model, optimizer, scaler, counters, KL coefficient, RNG, model version.
        A restarted trainer (`--resume auto`: `continue_run`) continues this run's latest checkpoint if
        there is one; otherwise `resume` decides (see TrainConfig.resume)."""
        from overworld.trainer.minestudio_checkpoint import import_checkpoint, is_minestudio_checkpoint

        which = (self.resume or "never").strip()
        if self.extra.get("continue_run") and self.checkpoints.resolve("latest") is not None:
            which = "latest"
        if which == "never":
            return
        if is_minestudio_checkpoint(which):
            import_checkpoint(which, self.unwrapped_model, self.optimizer if self.resume_optimizer else None,
                              self.scaler if self.resume_optimizer else None)
            self.resumed_from = which
            return
        ckpt_id = self.checkpoints.resolve("latest" if which == "auto" else which)
        if ckpt_id is None:
            if which == "latest":
                log.warning("resume=latest, but this run has no committed checkpoint yet: starting fresh")
            return
        ckpt = self.checkpoints.load(ckpt_id, ["model.safetensors", "optimizer.pt", "rng.pt", "scaler.pt",
                                               "reference.safetensors"])
        model = self.unwrapped_model
        model.load_state_dict(from_bytes(ckpt.files["model.safetensors"], model.state_dict()))
        if self.resume_optimizer and "optimizer.pt" in ckpt.files:
            self.optimizer.load_state_dict(tensors_from_bytes(ckpt.files["optimizer.pt"]))
        if self.resume_optimizer and "scaler.pt" in ckpt.files and self.scaler is not None:
            self.scaler.load_state_dict(tensors_from_bytes(ckpt.files["scaler.pt"]))
        if getattr(self, "reference", None) is not None and "reference.safetensors" in ckpt.files:
            self.reference.load_state_dict(from_bytes(ckpt.files["reference.safetensors"]))  # type: ignore[union-attr]
        s = ckpt.state
        self.iteration, self.updates = int(s["iteration"]), int(s["updates"])
        if "rng.pt" in ckpt.files:
            self.restore_rng(tensors_from_bytes(ckpt.files["rng.pt"]))
        self.samples_trained, self.env_steps = int(s["samples_trained"]), int(s["env_steps"])
        self.model_version, self.rho = int(s["model_version"]), float(s["rho"])
        self.resumed_from = ckpt_id
        self.latest_checkpoint = ckpt_id
        self.start = {"model_version": self.model_version, "env_steps": self.env_steps, "rho": self.rho}
        log.info("rank %d resumed from %s: iteration %d, model version %d, env steps %d, rho %.4g",
                 self.rank, ckpt_id, self.iteration, self.model_version, self.env_steps, self.rho)

    def publish_first_version(self) -> None:
        """On the driver, while Ray starts: a fresh run's starting weights as version 1, tagged
        `reference`, so that the workers step their envs with the learner's policy seconds after
        `overworld run` instead of after Ray Train is up. The learner builds the same weights from the
        same seed and does not publish them again (`publish_initial_version`). Nothing when the
        registry already has a version or a checkpoint will be resumed: the learner publishes those."""
        registry = ModelRegistryClient(self.model_registry)
        try:
            if registry.list_versions(timeout=60) or self._checkpoint_to_resume():
                return
            self.model, self.optimizer = self.build_starting_model()
            registry.publish(1, to_bytes(self.unwrapped_model.state_dict()), config_hash=config_hash(self.config))
            registry.set_tag("reference", 1)
            log.info("published the starting weights as version 1 (before Ray Train)")
        finally:
            registry.close()
            self.model = self.optimizer = self.reference = None  # type: ignore[assignment]  # the learner builds its own

    def _checkpoint_to_resume(self) -> bool:
        """Whether `restore()` will load a checkpoint (the same rules)."""
        from overworld.trainer.minestudio_checkpoint import is_minestudio_checkpoint

        store = checkpoint_store(self.config, self.workdir)
        if self.extra.get("continue_run") and store.resolve("latest") is not None:
            return True
        which = (self.resume or "never").strip()
        if which == "never":
            return False
        return is_minestudio_checkpoint(which) or store.resolve("latest" if which == "auto" else which) is not None

    def publish_initial_version(self) -> None:
        """Rank 0: publish the starting weights (version 1 on a fresh run, the next free version on a
        resume) so every worker acts with the learner's policy from its first step. When the driver
        published these very weights already (`publish_first_version`), only adopt its version."""
        if self.rank != 0:
            return
        versions = self.registry.list_versions(timeout=120)  # retried: the registry may be restarting too
        latest = max((v.version for v in versions), default=0)
        has_reference = any("reference" in v.tags for v in versions)
        if self.resumed_from is None and latest == 1 and self.model_version == 0:
            data = to_bytes(self.unwrapped_model.state_dict())
            if next(v for v in versions if v.version == 1).sha256 == hashlib.sha256(data).hexdigest():
                self.model_version = 1
                retry(lambda: self.buffer.SetModelVersion(
                    replay_buffer_pb2.SetModelVersionRequest(model_version=1), timeout=30), "SetModelVersion", 60)
                return
            log.warning("version 1 in the registry is not this learner's starting weights: publishing them anew")
        self.model_version = max(latest, self.model_version)
        self.broadcast_model_to_rollout_workers(new_version=True)
        if not has_reference:
            self.registry.set_tag("reference", self.model_version, timeout=120)

    # -- the Ray Train worker ------------------------------------------------------------------
    @property
    def unwrapped_model(self) -> Policy:
        model = self.model
        return model.module if hasattr(model, "module") else model  # type: ignore[return-value]

    def build_policy(self) -> Policy:
        _, policy, _, _ = run_spaces(self.config)
        return policy

    def build_starting_model(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """(model, optimizer) from the run's seed: the same weights in the driver (`publish_first_version`)
        and in every learner rank. Built on one thread: initialisers that factorise matrices (orthogonal
        init's QR) round differently with more threads, and the driver's weights would differ from the
        learner's. (Machines with different CPUs may still differ: the learner then publishes anew.)"""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            torch.manual_seed(self.config.seed)
            return self._as_policy_model(*self.setup_model_and_optimizer(self.policy_generator))
        finally:
            torch.set_num_threads(threads)

    def _as_policy_model(self, model: Any, optimizer: torch.optim.Optimizer,
                         *rest: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """What a MineStudio-style setup_model_and_optimizer returns: a MinePolicy (wrapped here; the
        optimizer keeps its parameters), and a GradScaler third in MineStudio's newer versions."""
        if rest and rest[0] is not None:
            self.scaler = rest[0]
        inner = getattr(model, "module", model)
        if not isinstance(inner, Policy):
            from overworld.policies.minestudio import as_policy

            _, _, _, action_space = run_spaces(self.config)
            model = as_policy(model, action_space).to(self.device)
            model.value_normalizer.enabled = self.config.train_config.use_normalized_vf
        return model, optimizer

    def _connect(self) -> None:
        t = self.config.train_config
        self.registry = ModelRegistryClient(self.model_registry)
        self.gae_client = GaeClient(self.gae)
        self.manager = RolloutManagerClient(self.rollout_manager)
        self._buffer_channel = channel(self.replay_buffer)
        self.buffer = replay_buffer_pb2_grpc.ReplayBufferStub(self._buffer_channel)
        self._status = trainer_pb2_grpc.TrainerStub(channel(self.status_address)) if self.status_address else None
        self.reader = ChunkReader(self.buffer, t.batch_size_per_gpu * t.batches_per_iteration, t.num_readers,
                                  t.prefetch_batches, t.sample_timeout, f"rank-{self.rank}", t.data_timeout)
        self.checkpoints = checkpoint_store(self.config, self.workdir)

    def report(self, state: str, metrics: dict[str, float]) -> bool:
        """Rank 0 tells the driver where training is; returns True when the driver asks to stop.
        Every rank gets the same answer."""
        stop = False
        if self.rank == 0 and self._status is not None:
            stop = self._report(state, metrics)
        if self.distributed:
            flag = torch.tensor(float(stop), device=self.device)
            dist.broadcast(flag, src=0)
            stop = bool(flag.item())
        return stop

    def _report(self, state: str, metrics: dict[str, float]) -> bool:
        try:
            assert self._status is not None
            reply = self._status.ReportProgress(trainer_pb2.TrainerStatus(
                state=state, iteration=self.iteration, updates=self.updates, model_version=self.model_version,
                samples_trained=self.samples_trained, metrics=metrics, resumed_from=self.resumed_from or "",
                start_model_version=self.start["model_version"], start_env_steps=self.start["env_steps"],
                start_rho=self.start["rho"], latest_checkpoint=self.latest_checkpoint, env_steps=self.env_steps),
                timeout=10)
            return bool(reply.stop)
        except Exception as err:  # the driver's status endpoint is advisory; training goes on
            log.warning("could not report progress: %s", err)
            return False

    def _train_func(self) -> None:
        if self.config.train_config.num_workers:
            import ray.train
            import ray.train.torch

            ctx = ray.train.get_context()
            self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
            require_usable_cuda()  # Ray gave this worker a GPU: it is used, or training stops here
            self.device = ray.train.torch.get_device()
        else:  # local mode, no Ray: one rank, the driver's GPU exactly when num_gpus_per_worker > 0
            self.rank, self.world_size = 0, 1
            self.device = local_mode_device(self.config.train_config.num_gpus_per_worker)
        torch.set_num_threads(1)
        self._connect()
        self.model, self.optimizer = self.build_starting_model()
        torch.manual_seed(self.config.seed * 7919 + self.rank)  # minibatch order; a resume restores it
        try:
            self.restore()
            self.train()
        finally:
            self.reader.close()


def _train_loop(loop_config: dict[str, Any]) -> None:
    """One learner rank: on a Ray Train worker, or in the driver's own thread in local mode."""
    from overworld.core.imports import import_object

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = from_yaml(loop_config["config_yaml"])
    cls = import_object(loop_config["trainer_class"])
    trainer: BaseTrainer = cls.from_config(config, **loop_config["addresses"])
    trainer._train_func()
