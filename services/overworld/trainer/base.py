"""BaseTrainer with MineStudio's API, run by Ray Train's TorchTrainer (DDP: gloo on CPU, NCCL on GPU).

`fit()` runs on the trainer driver; `_train_func()` runs in every Ray Train worker: it builds the
model and optimizer, restores a checkpoint if there is one, and calls `train()`: fetch chunks from the
replay buffer, estimate advantages with the gae service, update, and (rank 0) publish the new
version to the model registry. Everything around the update is a hook (trainer/hooks.py).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from overworld.core.blobs import open_blob_store
from overworld.core.config import RunConfig, as_dict, config_hash, from_yaml, to_yaml
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
    model_registry_pb2,
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


def checkpoint_store(config: RunConfig, workdir: str) -> CheckpointStore:
    """`train_config.save_path`: s3://BUCKET/PREFIX, or a directory (relative to the workdir)."""
    path = config.train_config.save_path
    location = path if path.startswith("s3://") or Path(path).is_absolute() else str(Path(workdir) / path)
    return CheckpointStore(open_blob_store(location), prefix=f"{config.run_id or 'run'}/checkpoints")


class BaseTrainer:
    def __init__(self, rollout_manager: str, policy_generator: str, env_generator: str, num_workers: int = 1,
                 num_readers: int = 1, num_cpus_per_reader: float = 0.1, num_gpus_per_worker: float = 0.0,
                 prefetch_batches: int = 2, discount: float = 0.999, gae_lambda: float = 0.95,
                 context_length: int = 64, use_normalized_vf: bool = False, inference_batch_size_per_gpu: int = 16,
                 resume: str | None = None, resume_optimizer: bool = True, *, config: RunConfig,
                 replay_buffer: str = "", gae: str = "", model_registry: str = "", status_address: str = "",
                 workdir: str = ".", **kwargs: Any) -> None:
        self.rollout_manager = rollout_manager
        self.policy_generator = policy_generator
        self.env_generator = env_generator
        self.num_workers = num_workers
        self.num_readers = num_readers
        self.num_cpus_per_reader = num_cpus_per_reader
        self.num_gpus_per_worker = num_gpus_per_worker
        self.prefetch_batches = prefetch_batches
        self.discount = discount
        self.gae_lambda = gae_lambda
        self.context_length = context_length
        self.use_normalized_vf = use_normalized_vf
        self.inference_batch_size_per_gpu = inference_batch_size_per_gpu
        self.resume = resume
        self.resume_optimizer = resume_optimizer
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
        self.rho = config.train_config.kl_divergence_coef_rho
        self.resumed_from: str | None = None
        self.start = {"model_version": 0, "env_steps": 0, "rho": self.rho}
        self.latest_checkpoint = ""
        self.timings: dict[str, float] = {}  # seconds of each part of the last iteration (trainer/*_seconds)

    @classmethod
    def from_config(cls, config: RunConfig, **addresses: Any) -> BaseTrainer:
        t = config.train_config
        return cls(addresses.pop("rollout_manager"), config.policy_generator, config.env_generator,
                   num_workers=t.num_workers, num_readers=t.num_readers, num_cpus_per_reader=t.num_cpus_per_reader,
                   num_gpus_per_worker=t.num_gpus_per_worker, prefetch_batches=t.prefetch_batches,
                   discount=t.discount, gae_lambda=t.gae_lambda, context_length=t.context_length,
                   use_normalized_vf=t.use_normalized_vf, resume=t.resume, resume_optimizer=t.resume_optimizer,
                   config=config, **addresses)

    # -- MineStudio's API --------------------------------------------------------------------
    def setup_model_and_optimizer(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError

    def train(self) -> None:
        raise NotImplementedError

    def train_iteration(self, batch: Batch) -> dict[str, float]:
        raise NotImplementedError

    def fit(self) -> None:
        """Run `_train_func` on `num_workers` Ray Train workers (the caller has done ray.init)."""
        from ray.train import RunConfig as RayRunConfig
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        t = self.config.train_config
        use_gpu = t.num_gpus_per_worker > 0 and torch.cuda.is_available()
        loop_config = {
            "trainer_class": f"{type(self).__module__}:{type(self).__qualname__}",
            "config_yaml": to_yaml(self.config),
            "addresses": {"rollout_manager": self.rollout_manager, "replay_buffer": self.replay_buffer,
                          "gae": self.gae, "model_registry": self.model_registry,
                          "status_address": self.status_address, "workdir": self.workdir},
        }
        resources = {"CPU": 1, **({"GPU": t.num_gpus_per_worker} if use_gpu else {})}
        trainer = TorchTrainer(
            train_loop_per_worker=_ray_train_loop, train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=t.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
            run_config=RayRunConfig(name=f"overworld-{self.config.run_id}",
                                    storage_path=str(Path(self.workdir, "ray").resolve())))
        trainer.fit()

    def broadcast_model_to_rollout_workers(self, new_version: int) -> None:
        """Publish the current weights as `new_version`; workers watching the registry swap them in."""
        if self.rank != 0:
            return
        started = time.monotonic()
        data = to_bytes(self.unwrapped_model.state_dict())
        counters = {"iteration": self.iteration, "updates": self.updates, "samples_trained": self.samples_trained,
                    "env_steps": self.env_steps}
        self.registry.publish(new_version, data, parent=self.model_version if new_version > self.model_version else 0,
                              counters=counters, config_hash=config_hash(self.config))
        self.model_version = new_version
        retry(lambda: self.buffer.SetModelVersion(
            replay_buffer_pb2.SetModelVersionRequest(model_version=new_version), timeout=30), "SetModelVersion", 60)
        self.timings["publish"] = time.monotonic() - started

    def fetch_fragments_and_estimate_advantages(self) -> Batch:
        """This rank's share of an iteration: chunks from the replay buffer, values recomputed by the
        learner, advantages and value targets from the gae service (V-trace if configured)."""
        t = self.config.train_config
        started = time.monotonic()
        batch = chains_from_chunks(self.reader.next(), self.device)
        sampled = time.monotonic()
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
        valued = time.monotonic()
        adv, target = self.gae_client.estimate(request, self.discount, self.gae_lambda, vtrace=t.vtrace)
        self.timings.update(sample=sampled - started, values=valued - sampled, gae=time.monotonic() - valued)
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
        """Resume from `resume` (see TrainConfig.resume) on every rank: model, optimizer, scaler,
        counters, KL coefficient, RNG, model version."""
        which = (self.resume or "auto").strip()
        if which == "never":
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
            torch.manual_seed(self.config.seed)
            self.model, self.optimizer = self.setup_model_and_optimizer()
            registry.publish(1, to_bytes(self.unwrapped_model.state_dict()), config_hash=config_hash(self.config))
            registry.set_tag("reference", 1)
            log.info("published the starting weights as version 1 (before Ray Train)")
        finally:
            registry.close()
            self.model = self.optimizer = self.reference = None  # type: ignore[assignment]  # the learner builds its own

    def _checkpoint_to_resume(self) -> bool:
        which = (self.resume or "auto").strip()
        return which != "never" and checkpoint_store(self.config, self.workdir).resolve(
            "latest" if which == "auto" else which) is not None

    def publish_initial_version(self) -> None:
        """Rank 0: publish the starting weights (version 1 on a fresh run, the next free version on a
        resume) so every worker acts with the learner's policy from its first step. When the driver
        published these very weights already (`publish_first_version`), only adopt its version."""
        if self.rank != 0:
            return
        versions = self.registry.stub.ListVersions(model_registry_pb2.ListVersionsRequest(), timeout=30).versions
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
        self.broadcast_model_to_rollout_workers(max(latest, self.model_version) + 1)
        if not has_reference:
            self.registry.stub.SetTag(model_registry_pb2.SetTagRequest(tag="reference", version=self.model_version),
                                      timeout=30)

    # -- the Ray Train worker ------------------------------------------------------------------
    @property
    def unwrapped_model(self) -> Policy:
        model = self.model
        return model.module if hasattr(model, "module") else model  # type: ignore[return-value]

    def build_policy(self) -> Policy:
        _, policy, _, _ = run_spaces(self.config)
        return policy

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
        self.model, self.optimizer = self.setup_model_and_optimizer()
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
