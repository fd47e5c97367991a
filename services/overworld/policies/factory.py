"""Building a run's environment spaces and policy from its config (used by workers and learners).

MineStudio's MinecraftSim envs and MinePolicy policies are adapted here, so every caller sees
overworld's dict spaces and Policy interface."""

from __future__ import annotations

from typing import Any

from overworld.core.config import RunConfig
from overworld.core.imports import call_generator, import_object
from overworld.core.specs import Spaces, TensorSpec, spaces_from_gym
from overworld.envs.minestudio import adapt_env, adapt_spaces
from overworld.policies.base import Policy


def build_policy(config: RunConfig, observation_space: Any, action_space: Any) -> Policy:
    policy = call_generator(import_object(config.policy_generator), dict(config.policy_kwargs),
                            observation_space=observation_space, action_space=action_space)
    if not isinstance(policy, Policy):
        from overworld.policies.minestudio import as_policy

        try:
            policy = as_policy(policy, action_space)
        except TypeError as err:
            raise TypeError(f"{config.policy_generator}: {err}") from None
    policy.value_normalizer.enabled = config.train_config.use_normalized_vf
    return policy


def describe_env(config: RunConfig) -> tuple[Any, Any]:
    """The env's spaces: from the generator's declared `observation_space`/`action_space` when it has
    them (building a Minecraft just to read its spaces takes minutes), else from one env built and closed."""
    generator = import_object(config.env_generator)
    if hasattr(generator, "observation_space") and hasattr(generator, "action_space"):
        return adapt_spaces(generator.observation_space, generator.action_space)
    env = adapt_env(call_generator(generator, dict(config.env_kwargs)))
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def run_spaces(config: RunConfig) -> tuple[Spaces, Policy, Any, Any]:
    obs_space, act_space = describe_env(config)
    policy = build_policy(config, obs_space, act_space)
    state = {k: TensorSpec(tuple(v.shape[1:]), str(v.dtype).removeprefix("torch."))
             for k, v in policy.initial_state(1).items()}
    return spaces_from_gym(obs_space, act_space, state), policy, obs_space, act_space
