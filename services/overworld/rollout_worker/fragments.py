"""Cuts each env slot's trajectory into fragments of `fragment_length` steps.

Every slot has its own write position: slots step at different times (resets off the hot path,
restarts), so fragments of different slots complete at different times. A slot whose env failed
mid-fragment drops its partial fragment and skips one sequence number, so that gae and the replay
buffer never chain the fragments on either side of the gap.
"""

from __future__ import annotations

import numpy as np

from overworld.core.specs import Spaces
from overworld.core.wire.fragment import STEP_FIELDS


class FragmentCutter:
    def __init__(self, spaces: Spaces, num_envs: int, length: int) -> None:
        self.spaces = spaces
        self.N, self.T = num_envs, length
        self.buf: dict[str, np.ndarray] = {}
        for k, s in spaces.obs.items():
            self.buf[f"obs.{k}"] = np.zeros((num_envs, length, *s.shape), s.dtype)
        for k, s in spaces.action.items():
            self.buf[f"action.{k}"] = np.zeros((num_envs, length, *s.shape), s.dtype)
        for k, dtype in STEP_FIELDS.items():
            self.buf[k] = np.zeros((num_envs, length), dtype)
        self.in_state = {k: np.zeros((num_envs, *s.shape), s.dtype) for k, s in spaces.state.items()}
        self.t = np.zeros(num_envs, np.int64)  # steps written (actions chosen) in the current fragment
        self.sequence = np.zeros(num_envs, np.int64)
        self.dropped = 0

    def record_action(self, slots: np.ndarray, obs: dict[str, np.ndarray], action: dict[str, np.ndarray],
                      first: np.ndarray, logp: np.ndarray, value: np.ndarray, model_version: int,
                      state_before: dict[str, np.ndarray] | None) -> None:
        """The policy chose `action` for `slots` (obs/first/... indexed like `slots`)."""
        t = self.t[slots]
        b = self.buf
        for k, v in obs.items():
            b[f"obs.{k}"][slots, t] = v
        for k, v in action.items():
            b[f"action.{k}"][slots, t] = v
        b["first"][slots, t] = first
        b["logp"][slots, t] = logp
        b["value"][slots, t] = value
        b["model_version"][slots, t] = model_version
        starting = t == 0
        if state_before is not None and starting.any():
            for k, v in state_before.items():
                self.in_state[k][slots[starting]] = v[starting]

    def record_outcome(self, slots: np.ndarray, reward: np.ndarray, terminated: np.ndarray, truncated: np.ndarray,
                       bootstrap_value: np.ndarray) -> np.ndarray:
        """The env stepped `slots`; returns the slots whose fragment is now complete."""
        t = self.t[slots]
        b = self.buf
        b["reward"][slots, t] = reward
        b["terminated"][slots, t] = terminated
        b["truncated"][slots, t] = truncated
        b["bootstrap_value"][slots, t] = bootstrap_value
        self.t[slots] = t + 1
        return slots[self.t[slots] == self.T]

    def take(self, slot: int, next_obs: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
        """The complete fragment of `slot` (copied) and its sequence number; the slot starts a new one."""
        data = {k: v[slot].copy() for k, v in self.buf.items()}
        for k, v in next_obs.items():
            data[f"next_obs.{k}"] = np.array(v[None], copy=True)
        for k, v in self.in_state.items():
            data[f"state.{k}"] = v[slot].copy()
        sequence = int(self.sequence[slot])
        self.sequence[slot] += 1
        self.t[slot] = 0
        return sequence, data

    def drop(self, slot: int) -> bool:
        """Forget the partial fragment of `slot`; True if it held any step."""
        had = bool(self.t[slot])
        if had:
            self.dropped += 1
            self.sequence[slot] += 1
        self.t[slot] = 0
        return had
