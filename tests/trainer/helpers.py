"""Build a PPOLearner and a synthetic batch without services or Ray."""

from __future__ import annotations

from pathlib import Path

import torch

from overworld.core.config import load_config
from overworld.policies.base import log_prob
from overworld.trainer.data import Batch
from overworld.trainer.learner import PPOLearner

ROOT = Path(__file__).resolve().parents[2]


def make_trainer(*overrides: str, world_size: int = 1, rank: int = 0,
                 cls: type[PPOLearner] = PPOLearner) -> PPOLearner:
    config = load_config(ROOT / "examples/cartpole.yaml", list(overrides))
    torch.manual_seed(config.seed)
    trainer = cls.from_config(config, rollout_manager="")
    trainer.world_size, trainer.rank = world_size, rank
    trainer.model, trainer.optimizer = trainer.setup_model_and_optimizer()
    trainer.lr_schedule = trainer.setup_lr_schedule(trainer.optimizer)
    return trainer


def make_batch(trainer: PPOLearner, B: int, L: int, seed: int = 0, episode_start: int | None = None,
               obs_shape: tuple[int, ...] = (4,), obs_dtype: torch.dtype = torch.float32,
               num_actions: int = 2) -> Batch:
    g = torch.Generator().manual_seed(seed)
    policy = trainer.unwrapped_model
    if obs_dtype == torch.uint8:
        obs = {"obs": torch.randint(0, 256, (B, L, *obs_shape), generator=g, dtype=torch.uint8)}
        next_obs = {"obs": torch.randint(0, 256, (B, 1, *obs_shape), generator=g, dtype=torch.uint8)}
    else:
        obs = {"obs": torch.randn(B, L, *obs_shape, generator=g)}
        next_obs = {"obs": torch.randn(B, 1, *obs_shape, generator=g)}
    first = torch.zeros(B, L, dtype=torch.bool)
    first[:, 0] = True
    if episode_start is not None:
        first[:, episode_start] = True
    action = {"action": torch.randint(0, num_actions, (B, L), generator=g)}
    with torch.no_grad():
        out, _ = policy(obs, policy.initial_state(B), first)
        behaviour_logp = log_prob(out.logits, action)
    zeros = torch.zeros(B, L)
    batch = Batch(obs=obs, next_obs=next_obs, action=action,
                  state=policy.initial_state(B), reward=torch.randn(B, L, generator=g),
                  terminated=torch.zeros(B, L, dtype=torch.bool), truncated=torch.zeros(B, L, dtype=torch.bool),
                  first=first, behaviour_logp=behaviour_logp, behaviour_value=zeros, bootstrap_value=zeros,
                  model_version=torch.ones(B, L, dtype=torch.int64))
    batch.advantage = torch.randn(B, L, generator=g)
    batch.value_target = torch.randn(B, L, generator=g)
    batch.old_vpred = out.vpred.detach()
    return batch


def flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])
