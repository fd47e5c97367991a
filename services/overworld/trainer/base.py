"""BaseTrainer with MineStudio's API, run by Ray Train's TorchTrainer (DDP: gloo on CPU, NCCL on GPU).

`fit()` runs on the trainer driver; `_train_func()` runs in every Ray Train worker: it builds the
model and optimizer, restores a checkpoint if there is one, and calls `train()`: fetch chunks from the
replay buffer, estimate advantages with the gae service, update, and (rank 0) publish the new
version to the model registry. Everything around the update is a hook (trainer/hooks.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from overworld.core.blobs import open_blob_store
from overworld.core.config import (
    RunConfig,
    TrainConfig,
    as_dict,
    config_hash,
    from_yaml,
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
from overworld.trainer.checkpoint import CheckpointStore, tensors_from_bytes, tensors_to_bytes
from overworld.trainer.data import Batch, chains_from_chunks
from overworld.trainer.hooks import Hooks
from overworld.trainer.prefetch import ChunkReader
from overworld.v1 import (
    replay_buffer_pb2,
    replay_buffer_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

log = logging.getLogger("overworld.trainer")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        x = x.clone()
        dist.all_reduce(x)
    return x


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


def checkpoint_store(config: RunConfig, workdir: str) -> CheckpointStore:
    """`train_config.save_path`: s3://BUCKET/PREFIX, or a directory (relative to the workdir)."""
    path = config.train_config.save_path or "output"  # null: the default location
    location = path if path.startswith("s3://") or Path(path).is_absolute() else str(Path(workdir) / path)
    return CheckpointStore(open_blob_store(location), prefix=f"{config.run_id or 'run'}/checkpoints")


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
                 inference_batch_size_per_gpu: int = 16, resume: str | None = None,
                 resume_optimizer: bool | None = None, *, config: RunConfig | None = None, replay_buffer: str = "",
                 gae: str = "", model_registry: str = "", status_address: str = "", workdir: str = ".",
                 whole_config: str | None = None, **kwargs: Any) -> None:
        given = {"num_workers": num_workers, "num_readers": num_readers, "num_cpus_per_reader": num_cpus_per_reader,
                 "num_gpus_per_worker": num_gpus_per_worker, "prefetch_batches": prefetch_batches,
                 "discount": discount, "gae_lambda": gae_lambda, "context_length": context_length,
                 "use_normalized_vf": use_normalized_vf, "resume": resume, "resume_optimizer": resume_optimizer}
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
        self.inference_batch_size_per_gpu = inference_batch_size_per_gpu
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
        return t.num_workers * t.batch_size_per_gpu * t.batches_per_iteration

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
        """Run `_train_func` on `num_workers` Ray Train workers (the caller has done ray.init)."""
        from ray.train import RunConfig as RayRunConfig
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        from overworld.online.generators import generator_ref

        t = self.config.train_config
        use_gpu = t.num_gpus_per_worker > 0 and torch.cuda.is_available()
        loop_config = {
            "trainer_class": generator_ref(type(self), "trainer_name"),  # a class from a user's file: by its path
            "config_yaml": to_yaml(self.config),
            "addresses": {"rollout_manager": self.rollout_manager, "replay_buffer": self.replay_buffer,
                          "gae": self.gae, "model_registry": self.model_registry,
                          "status_address": self.status_address, "workdir": self.workdir,
                          **({"continue_run": True} if self.extra.get("continue_run") else {})},
        }
        resources = {"CPU": 1, **({"GPU": t.num_gpus_per_worker} if use_gpu else {})}
        trainer = TorchTrainer(
            train_loop_per_worker=_ray_train_loop, train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=t.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
            run_config=RayRunConfig(name=f"overworld-{self.config.run_id}",
                                    storage_path=str(Path(self.workdir, "ray").resolve())))
        trainer.fit()

    def broadcast_model_to_rollout_workers(self, new_version: bool) -> None:
        """MineStudio's: with `new_version`, publish the current weights as the next model version;
        workers watching the registry swap them in. Rank 0 only. Versions are immutable in the registry,
        so `new_version=False` (re-send the current version) has nothing to publish."""
        if self.rank != 0 or not new_version:
            return
        version = self.model_version + 1
        data = to_bytes(self.unwrapped_model.state_dict())
        counters = {"iteration": self.iteration, "updates": self.updates, "samples_trained": self.samples_trained,
                    "env_steps": self.env_steps}
        self.registry.publish(version, data, parent=self.model_version, counters=counters,
                              config_hash=config_hash(self.config))
        self.model_version = version
        retry(lambda: self.buffer.SetModelVersion(
            replay_buffer_pb2.SetModelVersionRequest(model_version=version), timeout=30), "SetModelVersion", 60)

    def fetch_fragments_and_estimate_advantages(self, *, num_fragments: int | None = None) -> dict[str, Any]:
        """MineStudio's: this rank's share of `num_fragments` (default: fragments_per_iteration) with
        advantages. Returns MineStudio's keys: `records` (this rank's Batch of chains), `td_targets`,
        `advantages`, `old_logps` (the behaviour policy's, recorded at rollout), `old_vpreds` (B, L)
        tensors aligned with it, `rewards` (B,) summed per chain, and `old_pi_logits` (None: the
        update recomputes what it needs)."""
        if num_fragments is not None and num_fragments != self.fragments_per_iteration:
            raise ValueError(f"num_fragments={num_fragments}: this trainer reads {self.fragments_per_iteration} per "
                             "iteration (num_workers x batch_size_per_gpu x batches_per_iteration); change those")
        batch = self._fetch_batch()
        return {"records": batch, "rewards": batch.reward.sum(1), "td_targets": batch.value_target,
                "advantages": batch.advantage, "old_logps": batch.behaviour_logp, "old_pi_logits": None,
                "old_vpreds": batch.old_vpred}

    def _fetch_batch(self) -> Batch:
        """This rank's share of an iteration: chunks from the replay buffer, values recomputed by the
        learner, advantages and value targets from the gae service (V-trace if configured)."""
        t = self.config.train_config
        batch = chains_from_chunks(self.reader.next(), self.device)
        vpred, next_value, target_logp = self.compute_values(batch)
        value = self.unwrapped_model.value_normalizer.denormalize(vpred)
        request = {
            "reward": batch.reward.cpu().numpy(), "value": value.cpu().numpy().astype(np.float32),
            "terminated": batch.terminated.cpu().numpy(), "truncated": batch.truncated.cpu().numpy(),
            "bootstrap_value": batch.bootstrap_value.cpu().numpy(),
            "next_value": next_value.cpu().numpy().astype(np.float32)}
        if t.vtrace:
            request["behaviour_logp"] = batch.behaviour_logp.cpu().numpy()
            request["target_logp"] = target_logp.cpu().numpy().astype(np.float32)
        adv, target = self.gae_client.estimate(request, self.discount, self.gae_lambda, vtrace=t.vtrace)
        batch.advantage = torch.as_tensor(adv, device=self.device)
        batch.value_target = torch.as_tensor(target, device=self.device)
        batch.old_vpred = vpred
        return batch

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The learner's value predictions (B, L), the value after the last step (B,), and the
        learner's log-probs of the behaviour actions (B, L), in one pass over each chain."""
        from overworld.policies.base import log_prob

        model = self.unwrapped_model
        obs = {k: torch.cat([v, batch.next_obs[k]], 1) for k, v in batch.obs.items()}
        last_done = batch.terminated[:, -1:] | batch.truncated[:, -1:]
        out, _ = model(obs, batch.state, torch.cat([batch.first, last_done], 1))
        logits = {k: v[:, :-1] for k, v in out.logits.items()}
        next_value = model.value_normalizer.denormalize(out.vpred[:, -1])
        return out.vpred[:, :-1], next_value, log_prob(logits, batch.action)

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self) -> str:
        """Rank 0 writes the full training state; atomic (listed only once COMMITTED is written)."""
        files = {"model.safetensors": to_bytes(self.unwrapped_model.state_dict()),
                 "optimizer.pt": tensors_to_bytes(self.optimizer.state_dict()),
                 "rng.pt": tensors_to_bytes({"torch": torch.get_rng_state(),
                                             **({"cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})})}
        scaler = getattr(self, "scaler", None)
        if scaler is not None:
            files["scaler.pt"] = tensors_to_bytes(scaler.state_dict())
        if getattr(self, "reference", None) is not None:
            files["reference.safetensors"] = to_bytes(self.reference.state_dict())  # type: ignore[union-attr]
        state = {"iteration": self.iteration, "updates": self.updates, "samples_trained": self.samples_trained,
                 "env_steps": self.env_steps, "model_version": self.model_version, "rho": self.rho,
                 "run_id": self.config.run_id, "config_hash": config_hash(self.config), "saved_unix": time.time(),
                 "config": as_dict(self.config)}
        ckpt_id = self.checkpoints.save(self.iteration, state, files)
        self.checkpoints.prune(self.config.train_config.keep_interval, ckpt_id)
        self.latest_checkpoint = ckpt_id
        return ckpt_id

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
                              getattr(self, "scaler", None))
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
        if "scaler.pt" in ckpt.files and getattr(self, "scaler", None) is not None:
            self.scaler.load_state_dict(tensors_from_bytes(ckpt.files["scaler.pt"]))
        if "rng.pt" in ckpt.files:
            rng = tensors_from_bytes(ckpt.files["rng.pt"])
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        if getattr(self, "reference", None) is not None and "reference.safetensors" in ckpt.files:
            self.reference.load_state_dict(from_bytes(ckpt.files["reference.safetensors"]))  # type: ignore[union-attr]
        s = ckpt.state
        self.iteration, self.updates = int(s["iteration"]), int(s["updates"])
        self.samples_trained, self.env_steps = int(s["samples_trained"]), int(s["env_steps"])
        self.model_version, self.rho = int(s["model_version"]), float(s["rho"])
        self.resumed_from = ckpt_id
        self.latest_checkpoint = ckpt_id
        self.start = {"model_version": self.model_version, "env_steps": self.env_steps, "rho": self.rho}
        log.info("rank %d resumed from %s: iteration %d, model version %d, env steps %d, rho %.4g",
                 self.rank, ckpt_id, self.iteration, self.model_version, self.env_steps, self.rho)

    def publish_initial_version(self) -> None:
        """Rank 0: publish the starting weights (version 1 on a fresh run, the next free version on a
        resume) so every worker acts with the learner's policy from its first step."""
        if self.rank != 0:
            return
        versions = self.registry.list_versions(timeout=120)  # retried: the registry may be restarting too
        latest = max((v.version for v in versions), default=0)
        has_reference = any("reference" in v.tags for v in versions)
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
                                  t.prefetch_batches, t.sample_timeout, f"rank-{self.rank}")
        self.checkpoints = checkpoint_store(self.config, self.workdir)

    def report(self, state: str, metrics: dict[str, float]) -> bool:
        """Rank 0 tells the driver where training is; returns True when the driver asks to stop.
        Every rank gets the same answer."""
        stop = False
        if self.rank == 0 and self._status is not None:
            stop = self._report(state, metrics)
        if is_distributed():
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
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        torch.manual_seed(self.config.seed)
        torch.set_num_threads(1)
        self._connect()
        self.model, self.optimizer = self._as_policy_model(*self.setup_model_and_optimizer(self.policy_generator))
        torch.manual_seed(self.config.seed * 7919 + self.rank)  # minibatch order; a resume restores it
        try:
            self.restore()
            self.train()
        finally:
            self.reader.close()


def _ray_train_loop(loop_config: dict[str, Any]) -> None:
    from overworld.core.imports import import_object

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = from_yaml(loop_config["config_yaml"])
    cls = import_object(loop_config["trainer_class"])
    trainer: BaseTrainer = cls.from_config(config, **loop_config["addresses"])
    trainer._train_func()
