"""A stand-in for MinecraftSim: its observation and action spaces, its reset() without a seed, its
`terminated = truncated = done`, its dict actions of one-element arrays; no Java, no engine.

Also MineStudio-style generators (no arguments) and a small random-weight VPT for the tests."""

from __future__ import annotations

import time
from typing import Any

import gymnasium
import numpy as np

SIZE = 32
SMALL_VPT = {
    "attention_heads": 2, "attention_mask_style": "clipped_causal", "attention_memory_size": 32,
    "diff_mlp_embedding": False, "hidsize": 64, "img_shape": [SIZE, SIZE, 3], "impala_chans": [8, 16, 16],
    "impala_kwargs": {"post_pool_groups": 1}, "impala_width": 1,
    "init_norm_kwargs": {"batch_norm": False, "group_norm_groups": 1}, "n_recurrence_layers": 2,
    "only_img_input": True, "pointwise_ratio": 4, "pointwise_use_activation": False,
    "recurrence_is_residual": True, "recurrence_type": "transformer", "timesteps": 16,
    "use_pointwise_layer": True, "use_pre_lstm_ln": False,
}


class StandInSim(gymnasium.Env):
    def __init__(self, obs_size: tuple[int, int] = (SIZE, SIZE), time_limit: int = 25, step_seconds: float = 0.0) -> None:
        self.obs_size = obs_size
        self.time_limit = time_limit
        self.step_seconds = step_seconds  # a Minecraft step takes time; so can this one
        self.t = 0
        self.rng = np.random.default_rng(0)

    @property
    def observation_space(self) -> gymnasium.spaces.Dict:
        h, w = self.obs_size
        return gymnasium.spaces.Dict({"image": gymnasium.spaces.Box(0, 255, (h, w, 3), np.uint8)})

    @property
    def action_space(self) -> gymnasium.spaces.Dict:
        return gymnasium.spaces.Dict({"buttons": gymnasium.spaces.MultiDiscrete([8641]),
                                      "camera": gymnasium.spaces.MultiDiscrete([121])})

    def _obs(self) -> dict[str, Any]:
        return {"image": self.rng.integers(0, 256, (*self.obs_size, 3), dtype=np.uint8)}

    def reset(self) -> tuple[dict[str, Any], dict[str, Any]]:  # MinecraftSim.reset takes no seed
        self.t = 0
        return self._obs(), {"pov": np.zeros((360, 640, 3), np.uint8), "health": 20.0}

    def step(self, action: dict[str, Any]) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        assert set(action) == {"buttons", "camera"}, action
        for k, n in (("buttons", 8641), ("camera", 121)):
            a = np.asarray(action[k])
            assert a.shape == (1,) and 0 <= int(a[0]) < n, (k, a)
        self.t += 1
        if self.step_seconds:
            time.sleep(self.step_seconds)
        done = self.t >= self.time_limit
        reward = 1.0 if int(action["buttons"][0]) % 2 == 0 else 0.0
        return self._obs(), reward, done, done, {"pov": np.zeros((360, 640, 3), np.uint8)}

    def render(self) -> np.ndarray:
        return self._obs()["image"]

    def close(self) -> None:
        pass


def env_generator() -> StandInSim:
    return StandInSim()


def policy_generator() -> Any:
    from minestudio.models import VPTPolicy

    return VPTPolicy(policy_kwargs=SMALL_VPT)
