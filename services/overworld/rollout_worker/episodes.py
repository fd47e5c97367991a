"""Per-slot episode bookkeeping, and the bounded outbox of finished-episode statistics that the
heartbeat thread ships to the rollout-manager in batches (the env loop never waits on it)."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from overworld.v1 import rollout_manager_pb2 as mpb

OUTBOX_LIMIT = 10_000


class EpisodeTracker:
    def __init__(self, num_envs: int, discount: float, task: str) -> None:
        self.discount = discount
        self.task = task
        self.sum_reward = np.zeros(num_envs)
        self.discounted = np.zeros(num_envs)
        self.length = np.zeros(num_envs, np.int64)
        self._outbox: deque[mpb.EpisodeStats] = deque(maxlen=OUTBOX_LIMIT)
        self._lock = threading.Lock()
        self.finished = 0

    def stepped(self, slots: np.ndarray, reward: np.ndarray) -> None:
        self.discounted[slots] += reward * self.discount ** self.length[slots]
        self.sum_reward[slots] += reward
        self.length[slots] += 1

    def ended(self, slot: int, model_version: int, extras: dict[str, float],
              task: str | None = None) -> mpb.EpisodeStats:
        """`task`: the episode's own label (MineStudio's obs["task"]), else the run's."""
        stats = mpb.EpisodeStats(task=task or self.task, sum_reward=float(self.sum_reward[slot]),
                                 discounted_reward=float(self.discounted[slot]), length=int(self.length[slot]),
                                 model_version=model_version, extras=extras)
        with self._lock:
            self._outbox.append(stats)
        self.finished += 1
        self.forget(slot)
        return stats

    def forget(self, slot: int) -> None:
        """The slot's episode was lost (env restarted): nothing to report."""
        self.sum_reward[slot] = 0.0
        self.discounted[slot] = 0.0
        self.length[slot] = 0

    def take(self) -> list[mpb.EpisodeStats]:
        with self._lock:
            out = list(self._outbox)
            self._outbox.clear()
        return out
