"""The rollout workers that hold a lease at the rollout-manager, as a replay-buffer front knows them.

Room is reserved only for a worker that holds a lease, and a worker's room lives as long as its lease:
the front refreshes the lease list every `refresh` seconds (its housekeeping thread) and gives back the
room of holders missing from two lists in a row (two, so that a list fetched just before a worker
registered, by this front or another, cannot take the room it reserved a moment later). A Reserve that
names a worker the front does not know refreshes the list at once (at most every `miss_refresh`
seconds): a worker that has just registered is not refused. When the rollout-manager cannot be reached
the last list stands, and the index's reservation ttl is the fallback that frees a dead worker's room.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection

import grpc

log = logging.getLogger("overworld.replay_buffer.leases")


class Leases:
    def __init__(self, fetch: Callable[[], Collection[str]], refresh: float = 1.0, miss_refresh: float = 0.05) -> None:
        """`fetch` returns the worker ids holding a live lease (RolloutManagerClient.leases), or raises."""
        self._fetch = fetch
        self.refresh_seconds = refresh
        self._miss_refresh = miss_refresh
        self._lock = threading.Lock()
        self._live: frozenset[str] = frozenset()
        self._fetched_at = -float("inf")
        self._missing_once: set[str] = set()

    def holds(self, worker_id: str) -> bool:
        """Whether `worker_id` holds a lease (refreshing the list once if it is not on it)."""
        if worker_id in self._live:
            return True
        if time.monotonic() - self._fetched_at >= self._miss_refresh:
            self.refresh()
        return worker_id in self._live

    @property
    def count(self) -> int:
        """How many workers hold a lease, as last heard (at least 1: the one asking)."""
        return max(1, len(self._live))

    def refresh(self) -> bool:
        """Fetch the list; False when the rollout-manager could not be asked (the last list stands)."""
        try:
            live = frozenset(self._fetch())
        except grpc.RpcError as err:
            log.warning("could not list the fleet's leases (%s); keeping the last list", err.code().name)
            return False
        with self._lock:
            self._live, self._fetched_at = live, time.monotonic()
        return True

    def gone(self, holders: Collection[str]) -> list[str]:
        """Of the holders of room, those whose lease is gone: missing from this list and the one before.
        Refreshes the list first; nothing is gone while the rollout-manager cannot be asked."""
        if not self.refresh():
            return []
        with self._lock:
            missing = {h for h in holders if h not in self._live}
            gone = sorted(missing & self._missing_once)
            self._missing_once = missing - set(gone)
        return gone
