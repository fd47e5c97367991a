"""BaseTrainer with MineStudio's API, run by Ray Train's TorchTrainer (DDP: gloo on CPU, NCCL on GPU).

`fit()` runs on the trainer driver; `_train_func()` runs in every Ray Train worker: it builds the
model and optimizer, then loops: fetch chunks from the replay buffer, estimate advantages with the
gae service, `train_iteration()`, and (rank 0) publish the new version to the model registry.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from overworld.core.config import RunConfig, config_hash, from_yaml, to_yaml
from overworld.core.grpc_util import channel, retry
from overworld.core.weights import to_bytes
from overworld.gae.client import GaeClient
from overworld.model_registry.client import ModelRegistryClient
from overworld.policies.base import Policy
from overworld.rollout_worker.worker import run_spaces
from overworld.trainer.data import Batch, chains_from_chunks
from overworld.v1 import replay_buffer_pb2, replay_buffer_pb2_grpc, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger("overworld.trainer")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    if is_distributed():
        x = x.clone()
        dist.all_reduce(x)
    return x


class BaseTrainer:
    def __init__(self, rollout_manager: str, policy_generator: str, env_generator: str, num_workers: int = 1,
                 num_readers: int = 1, num_cpus_per_reader: float = 0.1, num_gpus_per_worker: float = 0.0,
                 prefetch_batches: int = 2, discount: float = 0.999, gae_lambda: float = 0.95,
                 context_length: int = 64, use_normalized_vf: bool = False, inference_batch_size_per_gpu: int = 16,
                 resume: str | None = None, resume_optimizer: bool = True, *, config: RunConfig,
                 replay_buffer: str, gae: str, model_registry: str, status_address: str = "",
                 storage_path: str = "", **kwargs: Any) -> None:
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
        self.storage_path = storage_path
        self.extra = kwargs
        # Set up in each Ray Train worker:
        self.rank = 0
        self.world_size = 1
        self.device = torch.device("cpu")
        self.model_version = 0
        self.iteration = 0
        self.updates = 0
        self.samples_trained = 0

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
    def setup_model_and_optimizer(self) -> tuple[Policy, torch.optim.Optimizer]:
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
                          "status_address": self.status_address, "storage_path": self.storage_path},
        }
        resources = {"CPU": 1, **({"GPU": t.num_gpus_per_worker} if use_gpu else {})}
        trainer = TorchTrainer(
            train_loop_per_worker=_ray_train_loop, train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=t.num_workers, use_gpu=use_gpu, resources_per_worker=resources),
            run_config=RayRunConfig(name=f"overworld-{self.config.run_id}", storage_path=self.storage_path or None))
        trainer.fit()

    def broadcast_model_to_rollout_workers(self, new_version: int) -> None:
        """Publish the current weights as `new_version`; workers watching the registry swap them in."""
        if self.rank != 0:
            return
        data = to_bytes(self.unwrapped_model.state_dict())
        counters = {"iteration": self.iteration, "updates": self.updates, "samples_trained": self.samples_trained}
        tags = ["reference"] if new_version == 1 else []
        self.registry.publish(new_version, data, parent=new_version - 1, counters=counters,
                              config_hash=config_hash(self.config), tags=tags)
        retry(lambda: self.buffer.SetModelVersion(
            replay_buffer_pb2.SetModelVersionRequest(model_version=new_version), timeout=30), "SetModelVersion", 60)

    def fetch_fragments_and_estimate_advantages(self, num_chunks: int) -> Batch:
        """Sample `num_chunks` chunks for this rank, recompute values with the learner, and call gae."""
        t = self.config.train_config
        chunks: list[replay_buffer_pb2.SampledChunk] = []
        while len(chunks) < num_chunks:
            request = replay_buffer_pb2.SampleRequest(num_chunks=num_chunks - len(chunks), timeout_seconds=t.sample_timeout,
                                                      reader_id=f"rank-{self.rank}", allow_partial=True)
            got = retry(lambda r=request: list(self.buffer.Sample(r, timeout=t.sample_timeout + 30)), "Sample", 600)
            if not got:
                log.info("rank %d waiting for data: %d of %d chunks", self.rank, len(chunks), num_chunks)
            chunks += got
        batch = chains_from_chunks(chunks, self.device)
        vpred, next_value = self.compute_values(batch)
        value = self.unwrapped_model.value_normalizer.denormalize(vpred)
        adv, target = self.gae_client.estimate({
            "reward": batch.reward.cpu().numpy(), "value": value.cpu().numpy().astype(np.float32),
            "terminated": batch.terminated.cpu().numpy(), "truncated": batch.truncated.cpu().numpy(),
            "bootstrap_value": batch.bootstrap_value.cpu().numpy(),
            "next_value": next_value.cpu().numpy().astype(np.float32)}, self.discount, self.gae_lambda)
        batch.advantage = torch.as_tensor(adv, device=self.device)
        batch.value_target = torch.as_tensor(target, device=self.device)
        batch.old_vpred = vpred
        return batch

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The learner's value predictions (B, L) and the value after the last step (B,)."""
        model = self.unwrapped_model
        obs = {k: torch.cat([v, batch.next_obs[k]], 1) for k, v in batch.obs.items()}
        last_done = (batch.terminated[:, -1:] | batch.truncated[:, -1:])
        first = torch.cat([batch.first, last_done], 1)
        out, _ = model(obs, batch.state, first)
        vpred = out.vpred[:, :-1]
        next_value = model.value_normalizer.denormalize(out.vpred[:, -1])
        return vpred, next_value

    # -- the Ray Train worker ------------------------------------------------------------------
    @property
    def unwrapped_model(self) -> Policy:
        model = self.model
        return model.module if hasattr(model, "module") else model  # type: ignore[return-value]

    def _connect(self) -> None:
        self.registry = ModelRegistryClient(self.model_registry)
        self.gae_client = GaeClient(self.gae)
        self._buffer_channel = channel(self.replay_buffer)
        self.buffer = replay_buffer_pb2_grpc.ReplayBufferStub(self._buffer_channel)
        self._status = trainer_pb2_grpc.TrainerStub(channel(self.status_address)) if self.status_address else None

    def report(self, state: str, metrics: dict[str, float]) -> None:
        if self.rank != 0 or self._status is None:
            return
        try:
            self._status.ReportProgress(trainer_pb2.TrainerStatus(
                state=state, iteration=self.iteration, updates=self.updates, model_version=self.model_version,
                samples_trained=self.samples_trained, metrics=metrics), timeout=10)
        except Exception as err:  # the driver's status endpoint is advisory; training goes on
            log.warning("could not report progress: %s", err)

    def _train_func(self) -> None:
        import ray.train

        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        torch.manual_seed(self.config.seed)
        np.random.seed(self.config.seed + self.rank)
        torch.set_num_threads(1)
        self._connect()
        self.model, self.optimizer = self.setup_model_and_optimizer()
        self.train()


def _ray_train_loop(loop_config: dict[str, Any]) -> None:
    from overworld.core.imports import import_object

    logging.basicConfig(level=logging.INFO)
    config = from_yaml(loop_config["config_yaml"])
    cls = import_object(loop_config["trainer_class"])
    trainer: BaseTrainer = cls.from_config(config, **loop_config["addresses"])
    trainer._train_func()


def build_policy_for_training(config: RunConfig) -> Policy:
    _, policy, _, _ = run_spaces(config)
    return policy

