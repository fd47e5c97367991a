"""Building a run's environment spaces and policy from its config (used by workers and learners)."""

from __future__ import annotations

from typing import Any

from overworld.core.config import RunConfig
from overworld.core.imports import call_generator, import_object
from overworld.core.specs import Spaces, TensorSpec, spaces_from_gym
from overworld.policies.base import Policy


def build_policy(config: RunConfig, observation_space: Any, action_space: Any) -> Policy:
    policy = call_generator(import_object(config.policy_generator), dict(config.policy_kwargs),
                            observation_space=observation_space, action_space=action_space)
    if not isinstance(policy, Policy):
        raise TypeError(f"{config.policy_generator} returned {type(policy).__name__}, not an overworld Policy "
                        "(wrap MineStudio policies with overworld.policies.minestudio)")
    policy.value_normalizer.enabled = config.train_config.use_normalized_vf
    return policy


def describe_env(config: RunConfig) -> tuple[Any, Any]:
    """Build one environment to read its spaces (no reset), then close it."""
    env = call_generator(import_object(config.env_generator), dict(config.env_kwargs))
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def run_spaces(config: RunConfig) -> tuple[Spaces, Policy, Any, Any]:
    """The run's spaces (recurrent state included) and a freshly initialised policy."""
    obs_space, act_space = describe_env(config)
    policy = build_policy(config, obs_space, act_space)
    state = {k: TensorSpec(tuple(v.shape[1:]), str(v.dtype).removeprefix("torch."))
             for k, v in policy.initial_state(1).items()}
    return spaces_from_gym(obs_space, act_space, state), policy, obs_space, act_space
