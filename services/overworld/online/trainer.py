"""MineStudio's BaseTrainer and PPOTrainer: its constructor, its attribute names and its subclassing
API over Overworld's trainer (trainer/runtime.py, trainer/learner.py), which never imports this.

A MineStudio subclass keeps working: it may override `setup_model_and_optimizer` (returning a
MinePolicy, wrapped by the runtime), `train_iteration`, `fetch_fragments_and_estimate_advantages`,
`ppo_update` or `broadcast_model_to_rollout_workers`, and read or set MineStudio's attribute names
(`discount`, `context_length`, ..., `inner_model`, `ref_model`, `kl_divergence_coef_rho`, `num_updates`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from overworld.core.config import RunConfig, TrainConfig, as_dict, load_config
from overworld.core.imports import generator_ref, lazy_import
from overworld.policies.base import Policy
from overworld.trainer.data import Batch
from overworld.trainer.learner import PPOLearner
from overworld.trainer.runtime import TrainerRuntime

# The train_config keys MineStudio's BaseTrainer keeps as attributes: here they read and write the config.
CONSTRUCTOR_KEYS = ("num_workers", "num_readers", "num_cpus_per_reader", "num_gpus_per_worker", "prefetch_batches",
                    "discount", "gae_lambda", "context_length", "use_normalized_vf", "inference_batch_size_per_gpu",
                    "use_amp", "resume", "resume_optimizer")


def _config_with(config: RunConfig | None, policy_generator: Any, env_generator: Any,
                 train: dict[str, Any]) -> RunConfig:
    """`config` (or the defaults) with MineStudio's constructor arguments applied: they are never dropped."""
    data = as_dict(config) if config is not None else {}
    data.setdefault("train_config", {}).update(train)
    for key, value in (("policy_generator", policy_generator), ("env_generator", env_generator)):
        if value is not None:
            data[key] = generator_ref(value, key)
    merged = load_config(data)
    if config is not None:
        merged.run_id = config.run_id
    return merged


def _train_config_attribute(name: str) -> property:
    def get(self: BaseTrainer) -> Any:
        t = self.config.train_config
        if name == "inference_batch_size_per_gpu":
            return t.inference_batch_size_per_gpu or t.batch_size_per_gpu
        return getattr(t, name)

    def set_(self: BaseTrainer, value: Any) -> None:
        setattr(self.config.train_config, name, value)

    return property(get, set_, doc=f"train_config.{name}")


class BaseTrainer(TrainerRuntime):
    """Constructed with MineStudio's arguments (the generators as callables or import paths,
    train_config's keys as keyword arguments, `whole_config`), or from a RunConfig (`config=`, what the
    services use). Keyword arguments that are train_config keys win over `config`."""

    def __init__(self, rollout_manager: str = "", policy_generator: Any = None, env_generator: Any = None,
                 num_workers: int | None = None, num_readers: int | None = None,
                 num_cpus_per_reader: float | None = None, num_gpus_per_worker: float | None = None,
                 prefetch_batches: int | None = None, discount: float | None = None, gae_lambda: float | None = None,
                 context_length: int | None = None, use_normalized_vf: bool | None = None,
                 inference_batch_size_per_gpu: int | None = None, use_amp: bool | None = None,
                 resume: str | None = None, resume_optimizer: bool | None = None, *, config: RunConfig | None = None,
                 replay_buffer: str = "", gae: str = "", model_registry: str = "", status_address: str = "",
                 workdir: str = ".", continue_run: bool = False, whole_config: str | None = None,
                 **kwargs: Any) -> None:
        given = {"num_workers": num_workers, "num_readers": num_readers, "num_cpus_per_reader": num_cpus_per_reader,
                 "num_gpus_per_worker": num_gpus_per_worker, "prefetch_batches": prefetch_batches,
                 "discount": discount, "gae_lambda": gae_lambda, "context_length": context_length,
                 "use_normalized_vf": use_normalized_vf, "inference_batch_size_per_gpu": inference_batch_size_per_gpu,
                 "use_amp": use_amp, "resume": resume, "resume_optimizer": resume_optimizer}
        train_keys = {f.name for f in dataclasses.fields(TrainConfig)}
        given = {k: v for k, v in given.items() if v is not None or (k == "resume" and config is None)}
        given.update({k: kwargs.pop(k) for k in list(kwargs) if k in train_keys})
        kwargs.pop("enable_ref_update", None)  # MineStudio stores it and never reads it (core/config.py)
        merged = _config_with(config, policy_generator, env_generator, given)
        super().__init__(merged, rollout_manager=rollout_manager, replay_buffer=replay_buffer, gae=gae,
                         model_registry=model_registry, status_address=status_address, workdir=workdir,
                         continue_run=continue_run)
        self.policy_generator = policy_generator if callable(policy_generator) else lazy_import(merged.policy_generator)
        self.env_generator = env_generator if callable(env_generator) else lazy_import(merged.env_generator)
        self.whole_config = whole_config
        self.extra = kwargs  # MineStudio's constructor takes anything; what it does not know is kept here

    @classmethod
    def from_config(cls, config: RunConfig, **addresses: Any) -> BaseTrainer:
        return cls(addresses.pop("rollout_manager", ""), config=config, **addresses)

    # -- MineStudio's names for Overworld's state (and CONSTRUCTOR_KEYS, below) ----------------------
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
        return self.reference


for _key in CONSTRUCTOR_KEYS:
    setattr(BaseTrainer, _key, _train_config_attribute(_key))


class PPOTrainer(BaseTrainer, PPOLearner):
    """MineStudio's PPOTrainer: PPOLearner's iteration through MineStudio's two overridable steps,
    `fetch_fragments_and_estimate_advantages` (a dict of tensors) and `ppo_update` (keyword arguments)."""

    def train_iteration(self, batch: Batch | None = None) -> dict[str, float] | None:
        """MineStudio's iteration: fetch this iteration's fragments with advantages, `ppo_update`, decay
        the KL coefficient. Returns the iteration's metrics (MineStudio returned None; an override that
        does is fine). Given a `batch` (tests, tools), only the update from that batch."""
        if batch is not None:
            return self.update(batch)
        with self.timed("fetch"):
            r = self.fetch_fragments_and_estimate_advantages(num_fragments=self.fragments_per_iteration)
        metrics = self.ppo_update(records=r["records"], td_targets=r["td_targets"], advantages=r["advantages"],
                                  old_logps=r["old_logps"], old_vpreds=r["old_vpreds"], rewards=r["rewards"])
        self.kl_divergence_coef_rho *= self.config.train_config.coef_rho_decay
        return metrics

    def fetch_fragments_and_estimate_advantages(self, *, num_fragments: int | None = None) -> dict[str, Any]:
        """This rank's share of `num_fragments` (default: fragments_per_iteration) with advantages, as
        MineStudio's keys: `records` (this rank's Batch of chains), `td_targets`, `advantages`,
        `old_logps` (the behaviour policy's, recorded at rollout), `old_vpreds` (B, L) tensors aligned
        with it, `rewards` (B,) summed per chain, and `old_pi_logits` (None: the update recomputes what
        it needs). Everything stays in host memory."""
        if num_fragments is not None and num_fragments != self.fragments_per_iteration:
            raise ValueError(f"num_fragments={num_fragments}: this trainer reads {self.fragments_per_iteration} per "
                             "iteration (num_workers x batch_size_per_gpu x batches_per_iteration); change those")
        batch = self.estimate_advantages(self.sample())
        return {"records": batch, "rewards": batch.reward.sum(1), "td_targets": batch.value_target,
                "advantages": batch.advantage, "old_logps": batch.behaviour_logp, "old_pi_logits": None,
                "old_vpreds": batch.old_vpred}

    def ppo_update(self, records: Batch, td_targets: torch.Tensor, advantages: torch.Tensor, old_logps: torch.Tensor,
                   old_vpreds: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
        """The PPO update over this rank's chains (`records`), with the tensors
        fetch_fragments_and_estimate_advantages returned (a subclass may change them first)."""
        records.value_target, records.advantage, records.behaviour_logp, records.old_vpred = (
            td_targets, advantages, old_logps, old_vpreds)
        metrics = self.update(records)
        metrics["trainer/buffer_reward"] = float(rewards.float().mean())
        return metrics
