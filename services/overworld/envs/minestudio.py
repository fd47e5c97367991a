"""MineStudio environments (MinecraftSim with its callbacks) as overworld envs, unchanged.

`adapt_env(env)` is applied to every env the rollout worker builds; it returns the env itself
unless the env speaks MineStudio's dialect:

- actions: a Dict of `MultiDiscrete([n])` (VPT's `buttons` 8641, `camera` 121) becomes a Dict of
  `Discrete(n)`; each step's integers go back to the env as `np.array([a])`;
- observations: only the array entries declared in the observation space (`image` (H, W, 3) uint8)
  travel (fragments and the worker's shared memory hold fixed-shape arrays); every other key is
  named in one warning per env process, except `task`, which labels the episode's statistics
  (MineStudio's `episode_statistics/{task}4train/...`) through `info["task"]`;
- `reset()` takes no seed (MinecraftSim), `reset(seed=...)` is accepted and the seed dropped;
- episode ends: MinecraftSim reports the engine's `done` (a death) as terminated *and* truncated,
  which is a termination; MineStudio's `JudgeResetCallback` reports its time limit as terminated
  alone, which is a truncation here (the value of the last observation is bootstrapped).

Nothing here imports minestudio.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, TypeGuard

import gymnasium as gym
import numpy as np

log = logging.getLogger("overworld.envs.minestudio")
_warned_keys: set[str] = set()


def _warn_dropped(keys: set[str], why: str) -> None:
    new = sorted(keys - _warned_keys)
    if new:
        _warned_keys.update(new)
        log.warning("observation keys %s do not reach the policy: %s", ", ".join(new), why)


def task_label(task: Any) -> str | None:
    """MineStudio's obs["task"]: a string, or TaskCallback's {"name": ..., "text": ...}."""
    if isinstance(task, str):
        return task
    if isinstance(task, dict) and isinstance(task.get("name"), str):
        return task["name"]
    return None


def _one_slot_multidiscrete(space: gym.Space) -> TypeGuard[gym.spaces.MultiDiscrete]:
    return isinstance(space, gym.spaces.MultiDiscrete) and space.shape == (1,)


def adapt_action_space(space: gym.Space) -> gym.Space:
    if isinstance(space, gym.spaces.Dict) and any(_one_slot_multidiscrete(s) for s in space.spaces.values()):
        return gym.spaces.Dict({k: gym.spaces.Discrete(int(s.nvec[0])) if _one_slot_multidiscrete(s) else s
                                for k, s in space.spaces.items()})
    return space


def adapt_observation_space(space: gym.Space) -> gym.Space:
    if isinstance(space, gym.spaces.Dict):
        kept: dict[str, gym.Space] = {k: s for k, s in space.spaces.items() if isinstance(s, gym.spaces.Box | gym.spaces.Discrete)}
        if len(kept) != len(space.spaces):
            return gym.spaces.Dict(kept)
    return space


def adapt_spaces(observation_space: gym.Space, action_space: gym.Space) -> tuple[gym.Space, gym.Space]:
    return adapt_observation_space(observation_space), adapt_action_space(action_space)


def needs_adapter(env: Any) -> bool:
    obs, act = env.observation_space, env.action_space
    return adapt_spaces(obs, act) != (obs, act)


def _takes_seed(env: Any) -> bool:
    try:
        return "seed" in inspect.signature(env.reset).parameters
    except (TypeError, ValueError):
        return False


class MineStudioEnv(gym.Env):
    """A MinecraftSim-like env seen through overworld's spaces."""

    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, env: Any) -> None:
        self.env = env
        self.observation_space, self.action_space = adapt_spaces(env.observation_space, env.action_space)
        self._raw_action_space = env.action_space
        self._takes_seed = _takes_seed(env)
        self.task: str | None = None
        raw = env.observation_space
        if isinstance(raw, gym.spaces.Dict) and isinstance(self.observation_space, gym.spaces.Dict):
            _warn_dropped(set(raw.spaces) - set(self.observation_space.spaces),
                          "their spaces are not fixed-shape arrays (Box or Discrete)")
        self._time_limits = time_limit_callbacks(env)

    def _obs(self, obs: Any) -> Any:
        if isinstance(self.observation_space, gym.spaces.Dict) and isinstance(obs, dict):
            self.task = task_label(obs.get("task")) or self.task
            kept = self.observation_space.spaces
            if len(obs) > len(kept):
                _warn_dropped(set(obs) - set(kept) - {"task"},
                              "the env's observation_space does not declare them as fixed-shape arrays")
            return {k: obs[k] for k in kept}
        return obs

    def _info(self, info: Any) -> Any:
        if self.task is not None and isinstance(info, dict):
            return {**info, "task": self.task}
        return info

    def _action(self, action: Any) -> Any:
        raw = self._raw_action_space
        if not isinstance(raw, gym.spaces.Dict) or not isinstance(action, dict):
            return action
        return {k: np.asarray([int(np.asarray(v).reshape(-1)[0])], np.int64) if _one_slot_multidiscrete(raw[k])
                else v for k, v in action.items()}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict]:
        out = self.env.reset(seed=seed) if self._takes_seed and seed is not None else self.env.reset()
        obs, info = out if isinstance(out, tuple) else (out, {})
        self.task = None
        return self._obs(obs), self._info(info)

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        limit_reached = any(cb.time_step + 1 >= cb.time_limit for cb in self._time_limits)
        obs, reward, terminated, truncated, info = self.env.step(self._action(action))
        terminated, truncated = bool(terminated), bool(truncated)
        obs, info = self._obs(obs), self._info(info)
        if terminated and truncated:  # MinecraftSim's `done, done`: the engine ended the episode (a death)
            return obs, float(reward), True, False, info
        if terminated and limit_reached:  # JudgeResetCallback's time limit, reported as terminated
            return obs, float(reward), False, True, info
        return obs, float(reward), terminated, truncated, info

    def render(self) -> Any:
        return self.env.render()

    def close(self) -> None:
        self.env.close()


def time_limit_callbacks(env: Any) -> list[Any]:
    """MinecraftSim's callbacks that end an episode after `time_limit` steps, counting `time_step`
    (MineStudio's JudgeResetCallback; duck-typed, so that nothing here imports minestudio)."""
    return [cb for cb in getattr(env, "callbacks", None) or []
            if isinstance(getattr(cb, "time_limit", None), int) and isinstance(getattr(cb, "time_step", None), int)]


def adapt_env(env: Any) -> Any:
    return MineStudioEnv(env) if needs_adapter(env) else env
