"""What runs around the learner: its connections to the services, publishing, status, checkpoints,
the iteration loop's accounting and Ray Train. The algorithm is trainer/learner.py; MineStudio's
names for both are overworld/online/trainer.py (which imports this, never the reverse).

`fit()` runs on the trainer driver: it places the workers (trainer/placement.py: GPUs follow
`num_gpus_per_worker` and the cluster, never the driver's own hardware) and starts Ray Train, or, with
`train_config.num_workers: 0`, runs one learner in the driver's own thread without Ray (local mode).
`_train_func()` runs in every learner rank: it connects, builds the model and optimizer, restores a
checkpoint if there is one, and calls `train()`, which calls the learner's `train_iteration()` once per
iteration. Everything around an iteration is a hook (trainer/hooks.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist

from overworld.core.config import (
    RunConfig,
    chunks_per_iteration,
    config_hash,
    from_yaml,
    to_yaml,
)
from overworld.core.imports import generator_ref, import_object, lazy_import
from overworld.core.wire.weights import to_bytes
from overworld.gae.client import GaeClient
from overworld.model_registry.client import ModelRegistryClient
from overworld.policies.base import Policy
from overworld.policies.factory import run_spaces
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.trainer import checkpoint, training_state
from overworld.trainer.builtin_hooks import register_builtin_hooks
from overworld.trainer.client import TrainerClient
from overworld.trainer.hooks import Hooks
from overworld.trainer.placement import (
    local_mode_device,
    require_usable_cuda,
    reserve_workers,
    torch_trainer_class,
    worker_resources,
)
from overworld.trainer.stopping import StopDeadline, StoppedWaiting, watch_for_stop
from overworld.trainer.training_state import FleetMark, StartPoint
from overworld.v1 import (
    trainer_pb2,
)

log = logging.getLogger("overworld.trainer")


class TrainerRuntime:
    """One learner's state and everything it talks to. A subclass supplies the algorithm:
    `setup_model_and_optimizer()` and `train_iteration()` (trainer/learner.py's PPOLearner)."""

    def __init__(self, config: RunConfig, *, rollout_manager: str = "", replay_buffer: str = "", gae: str = "",
                 model_registry: str = "", status_address: str = "", workdir: str = ".",
                 continue_run: bool = False) -> None:
        self.config = config
        self.rollout_manager, self.replay_buffer, self.gae = rollout_manager, replay_buffer, gae
        self.model_registry, self.status_address, self.workdir = model_registry, status_address, workdir
        self.continue_run = continue_run  # a restarted trainer: this run's latest checkpoint comes first
        self.policy_generator = lazy_import(config.policy_generator) if config.policy_generator else None
        self.hooks = Hooks()
        # Training state, set up in each learner rank and saved in every checkpoint.
        self.rank = 0
        self.world_size = 1
        self.device = torch.device("cpu")
        self.model_version = 0
        self.iteration = 0
        self.updates = 0
        self.samples_trained = 0
        self.lag_steps: Counter[int] = Counter()
        self.sample_wait_seconds = 0.0
        self.env_steps = 0  # every env step of the run: those before this fleet and this fleet's
        self.fleet: FleetMark = {"id": "", "env_steps": 0}
        self.rho = config.train_config.kl_divergence_coef_rho
        self.resumed_from: str | None = None
        self.start: StartPoint = {"model_version": 0, "env_steps": 0, "rho": self.rho}
        self.latest_checkpoint = ""
        self.timings: dict[str, float] = {}  # seconds of each part of the last iteration (trainer/*_seconds)
        self.stop_deadline = StopDeadline()  # set once the driver says stop by a deadline
        self.cut_short = False  # the last update stopped early for the stop's deadline
        self.step_seconds = 0.0  # the last optimizer step's minibatches (how close to a deadline one more fits)
        # How long fit() waits for the cluster to offer the workers' resources (train_config.
        # placement_timeout); the driver sets 0 for a Ray it started itself: that cluster cannot grow.
        self.placement_timeout = config.train_config.placement_timeout
        self.own_ray = False  # the driver started this Ray itself (see placement.torch_trainer_class)
        self.model: Any = None
        self.optimizer: Any = None
        self.lr_schedule: Any = None  # the learner's (setup_lr_schedule), over the optimizer
        self.reference: Policy | None = None
        self.amp_dtype: torch.dtype | None = None  # set with the optimizer (learner.amp_settings)
        self.scaler: torch.amp.GradScaler | None = None  # fp16 only; saved in every checkpoint (scaler.pt)

    @classmethod
    def from_config(cls, config: RunConfig, **addresses: Any) -> TrainerRuntime:
        return cls(config=config, **addresses)

    # -- what the learner supplies ---------------------------------------------------------------
    def setup_model_and_optimizer(self, policy_generator: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        raise NotImplementedError

    def train_iteration(self, batch: Any = None) -> dict[str, float] | None:
        raise NotImplementedError

    @contextlib.contextmanager
    def timed(self, part: str) -> Iterator[None]:
        """Seconds the block takes, as this iteration's `trainer/<part>_seconds`."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.timings[part] = time.monotonic() - started

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

    @property
    def fragments_per_iteration(self) -> int:
        """Chunks of one iteration, all ranks (num_workers x batch_size_per_gpu x batches_per_iteration)."""
        return chunks_per_iteration(self.config.train_config)

    # -- the iteration loop --------------------------------------------------------------------
    def train(self) -> None:
        """`num_iterations` iterations (or until the driver asks to stop), each the learner's
        `train_iteration()` between the hooks, with the fleet's env steps counted and reported."""
        t = self.config.train_config
        logger = register_builtin_hooks(self)
        for ref in t.hooks:
            import_object(ref)(self)
        self.publish_initial_version()
        stop = self.report("running", {})  # asked to stop while Ray Train started: no iteration to finish
        if stop:
            log.info("stop requested before the first iteration: finishing")
        try:
            while not stop and self.iteration < t.num_iterations:
                self.iteration += 1
                started = time.monotonic()
                fleet = self._ask_fleet()  # answered while this iteration runs: no round trip of its own
                self.hooks.run("pre_collect", self)
                updates_before = self.updates
                try:
                    metrics = dict(self.train_iteration() or {})
                except StoppedWaiting:
                    self.iteration -= 1
                    log.info("stop requested while waiting for samples: iteration %d not trained; "
                             "checkpointing iteration %d and finishing", self.iteration + 1, self.iteration)
                    break
                self.lr_schedule.step()
                if self.cut_short:  # no hooks (publishing, logging): the deadline leaves time for the checkpoint only
                    training_state.count_env_steps(self, fleet)
                    log.info("stop requested: update of iteration %d cut short after %d optimizer steps, to "
                             "checkpoint before the deadline", self.iteration, self.updates - updates_before)
                    break
                updated = time.monotonic()
                fetched = sum(self.timings.get(part, 0.0) for part in ("sample", "values", "gae"))
                self.timings["update"] = updated - started - fetched  # the PPO epochs (hooks included)
                if self.iteration == 1 and self.rank == 0:
                    log.info("first update done: %d optimizer steps", self.updates)
                new_steps = training_state.count_env_steps(self, fleet)
                metrics.update({
                    "trainer/utd_ratio": (self.updates - updates_before) / new_steps if new_steps else math.nan,
                    "trainer/env_steps_all_workers": float(self.env_steps),
                })
                with self.timed("post_iteration"):
                    self.hooks.run("post_iteration", self, metrics=metrics)
                metrics.update({f"trainer/{k}_seconds": v for k, v in self.timings.items()})
                metrics["trainer/iteration_seconds"] = time.monotonic() - started
                if self.report("running", metrics):
                    log.info("stop requested: checkpointing iteration %d and finishing", self.iteration)
                    break
        finally:
            logger.close()
        # The fleet's steps up to the stop, in the last checkpoint: a resumed run goes on from there. This
        # iteration's own checkpoint, written before the stop came, gets them in its state (rank 0 only:
        # no collective).
        counted = training_state.count_env_steps(self, self._ask_fleet())
        if t.save_interval > 0 and self.latest_checkpoint != checkpoint.checkpoint_id(self.iteration):
            self.save_checkpoint()
        elif t.save_interval > 0 and counted and self.rank == 0:
            self.checkpoints.update_state(self.latest_checkpoint, env_steps=self.env_steps, fleet=self.fleet)
        self.report("finished", {})

    def _ask_fleet(self, timeout: float = 5.0) -> grpc.Future | None:
        """The fleet's status, asked now and answered while the caller works (waits for a manager
        that is restarting, up to `timeout`)."""
        try:
            return self.manager.fleet_status_future(timeout=timeout)
        except Exception:  # statistics only: never stall training on the manager
            return None

    # -- Ray Train ------------------------------------------------------------------------------
    def fit(self) -> None:
        """Place `num_workers` Ray Train workers and run `_train_func` on each (the caller has done
        ray.init). A worker gets a GPU exactly when `num_gpus_per_worker > 0`; a cluster without
        them fails here, with how many were asked and how many the cluster has. `num_workers: 0` is
        local mode (what Ray Train's local mode did, without Ray): `_train_func` runs here, in this
        thread, and Ray is never imported, so that a machine without Ray trains (on this machine's
        GPU exactly when `num_gpus_per_worker > 0`)."""
        t = self.config.train_config
        loop_config = {
            "trainer_class": generator_ref(type(self), "trainer_name"),  # a class from a user's file: by its path
            "config_yaml": to_yaml(self.config),
            "addresses": {"rollout_manager": self.rollout_manager, "replay_buffer": self.replay_buffer,
                          "gae": self.gae, "model_registry": self.model_registry,
                          "status_address": self.status_address, "workdir": self.workdir,
                          **({"continue_run": True} if self.continue_run else {})},
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
        self.lr_schedule = self.setup_lr_schedule(self.optimizer)
        torch.manual_seed(self.config.seed * 7919 + self.rank)  # minibatch order; a resume restores it
        done = watch_for_stop(self._status, self.reader, self.stop_deadline.set)
        try:
            self.restore()
            self.train()
        finally:
            done.set()
            self.reader.close()

    def _connect(self) -> None:
        t = self.config.train_config
        self.registry = ModelRegistryClient(self.model_registry)
        self.gae_client = GaeClient(self.gae)
        self.manager = RolloutManagerClient(self.rollout_manager)
        self.buffer = ReplayBufferClient(self.replay_buffer)
        self._status = TrainerClient(self.status_address) if self.status_address else None
        self.reader = self.buffer.reader(t.batch_size_per_gpu * t.batches_per_iteration, t.num_readers,
                                         t.prefetch_batches, f"rank-{self.rank}", wait=t.sample_timeout,
                                         data_timeout=t.data_timeout)
        self.checkpoints = checkpoint.checkpoint_store(self.config, self.workdir)

    # -- the model -------------------------------------------------------------------------------
    @property
    def unwrapped_model(self) -> Policy:
        model = self.model
        return model.module if hasattr(model, "module") else model

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

    def setup_lr_schedule(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        """The learning rate of each iteration: the optimizer's, annealed linearly to 0 over
        `num_iterations` with `anneal_lr_linearly` (CleanRL's schedule: iteration i trains at
        1 - (i-1)/num_iterations of it). Built with the optimizer, stepped by the loop after every
        iteration, kept in every checkpoint (lr_schedule.pt); a subclass may return its own."""
        t = self.config.train_config
        if t.anneal_lr_linearly:
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: max(0.0, 1 - done / t.num_iterations))
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1.0)

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

    # -- publishing ------------------------------------------------------------------------------
    def broadcast_model_to_rollout_workers(self, new_version: bool) -> None:
        """(MineStudio's name.) With `new_version`, publish the current weights as the next model
        version; workers watching the registry swap them in. Rank 0 only. Versions are immutable in the
        registry, so `new_version=False` (re-send the current version) has nothing to publish."""
        if self.rank != 0 or not new_version:
            return
        with self.timed("publish"):
            version = self.model_version + 1
            data = to_bytes(self.unwrapped_model.state_dict())
            counters = {"iteration": self.iteration, "updates": self.updates,
                        "samples_trained": self.samples_trained, "env_steps": self.env_steps}
            self.registry.publish(version, data, parent=self.model_version, counters=counters,
                                  config_hash=config_hash(self.config))
            self.model_version = version
            self.buffer.set_model_version(version)

    def publish_first_version(self) -> None:
        """On the driver, while Ray starts: a fresh run's starting weights as version 1, tagged
        `reference`, so that the workers step their envs with the learner's policy seconds after
        `overworld run` instead of after Ray Train is up. The learner builds the same weights from the
        same seed and does not publish them again (`publish_initial_version`). Nothing when the
        registry already has a version or a checkpoint will be resumed: the learner publishes those."""
        registry = ModelRegistryClient(self.model_registry)
        try:
            store = checkpoint.checkpoint_store(self.config, self.workdir)
            if registry.list_versions(timeout=60) or training_state.will_resume(self, store):
                return
            self.model, self.optimizer = self.build_starting_model()
            registry.publish(1, to_bytes(self.unwrapped_model.state_dict()), config_hash=config_hash(self.config))
            registry.set_tag("reference", 1)
            log.info("published the starting weights as version 1 (before Ray Train)")
        finally:
            registry.close()
            self.model = self.optimizer = self.reference = None  # the learner builds its own

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
                self.buffer.set_model_version(1)
                return
            log.warning("version 1 in the registry is not this learner's starting weights: publishing them anew")
        self.model_version = max(latest, self.model_version)
        self.broadcast_model_to_rollout_workers(new_version=True)
        if not has_reference:
            self.registry.set_tag("reference", self.model_version, timeout=120)

    # -- checkpoints (trainer/checkpoint.py) -------------------------------------------------------
    def save_checkpoint(self) -> str:
        """Every rank calls it (the RNG states are gathered); rank 0 writes the full training state."""
        started = time.monotonic()
        saved = training_state.save(self)
        self.stop_deadline.checkpoint_seconds = time.monotonic() - started  # what a deadline must leave room for
        return saved

    def restore(self) -> None:
        """Resume on every rank from what `resume` (or a restart: `continue_run`) names."""
        training_state.restore(self)

    # -- status ----------------------------------------------------------------------------------
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
            return self._status.report(trainer_pb2.TrainerStatus(
                state=state, iteration=self.iteration, updates=self.updates, model_version=self.model_version,
                samples_trained=self.samples_trained, metrics=metrics, resumed_from=self.resumed_from or "",
                start_model_version=self.start["model_version"], start_env_steps=self.start["env_steps"],
                start_rho=self.start["rho"], latest_checkpoint=self.latest_checkpoint, env_steps=self.env_steps))
        except Exception as err:  # the driver's status endpoint is advisory; training goes on
            log.warning("could not report progress: %s", err)
            return False


def _train_loop(loop_config: dict[str, Any]) -> None:
    """One learner rank: on a Ray Train worker, or in the driver's own thread in local mode."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = from_yaml(loop_config["config_yaml"])
    cls = import_object(loop_config["trainer_class"])
    trainer: TrainerRuntime = cls.from_config(config, **loop_config["addresses"])
    trainer._train_func()
