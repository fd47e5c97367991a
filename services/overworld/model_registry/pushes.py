"""Who is watching the registry and how far each push has got: the watchers with their open Watch
streams, the version each one runs, and for every published version the acknowledgements of the
watchers connected when it was announced (GetPushStatus, the push-latency metrics)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from prometheus_client import Gauge, Histogram

from overworld.model_registry.relay_plan import Member
from overworld.v1 import model_registry_pb2 as pb

log = logging.getLogger("overworld.model_registry")

PUSH_LATENCY = Histogram("overworld_registry_push_latency_seconds",
                         "Publish (manifest received) to the last watcher connected at that time acknowledging",
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
LAST_PUSH_LATENCY = Gauge("overworld_registry_last_push_latency_seconds",
                          "Push latency of the most recent completely pushed version")
WATCHERS = Gauge("overworld_registry_watchers", "Open watch streams (distinct watcher ids)")
WORKERS_PER_VERSION = Gauge("overworld_registry_workers_per_version",
                            "Connected watchers by the model version they last acknowledged (or resumed with)",
                            ["version"])

PUSH_HISTORY = 64  # push results kept for GetPushStatus


@dataclass
class Push:
    """Acknowledgements of one published version by the watchers connected when it was announced."""

    started: float  # monotonic, manifest received
    started_unix: float
    waiting: set[str]
    expected: int
    acked: int = 0
    finished: float = 0.0  # monotonic, last acknowledgement
    observed: bool = False
    watchers_left: set[str] = field(default_factory=set)
    ack_seconds: list[float] = field(default_factory=list)  # publish -> each acknowledgement

    @property
    def complete(self) -> bool:
        return not self.waiting


class PushTracker:
    """Watchers, the versions they run, and the pushes in progress. Every method runs with `lock` (the
    registry's Condition) held; it is notified when a push completes."""

    def __init__(self, lock: threading.Condition) -> None:
        self.lock = lock
        self.streams: dict[str, int] = {}  # watcher id -> open Watch streams
        self.running: dict[str, int] = {}  # watcher id -> version it acknowledged (or resumed with)
        self.members: dict[str, Member] = {}  # watcher id -> where it relays, in the order they joined
        self.pushes: dict[int, Push] = {}

    # -- watchers ---------------------------------------------------------------------------------
    def joined(self, member: Member, known: int) -> None:
        watcher = member.watcher
        self.streams[watcher] = self.streams.get(watcher, 0) + 1
        self.members.pop(watcher, None)
        self.members[watcher] = member  # a reconnected watcher goes to the end of the join order
        if known and self.running.get(watcher, 0) < known:
            self.running[watcher] = known
        self._update_gauges()

    def left(self, watcher: str) -> None:
        self.streams[watcher] -= 1
        if not self.streams[watcher]:
            del self.streams[watcher]
            self.running.pop(watcher, None)
            self.members.pop(watcher, None)
            for number, push in list(self.pushes.items()):
                if watcher in push.waiting:
                    push.waiting.discard(watcher)
                    push.watchers_left.add(watcher)
                    self._maybe_finish(number, push)
        self._update_gauges()

    def member_list(self, precision: str) -> list[Member]:
        """The watchers a relay plan is made of: those that take announcements with sources."""
        return [m for m in self.members.values() if m.precision == precision and m.relayed]

    # -- pushes -----------------------------------------------------------------------------------
    def start(self, version: int, started: float, started_unix: float) -> None:
        if self.streams:
            self.pushes[version] = Push(started, started_unix, set(self.streams), len(self.streams))
            for old in sorted(self.pushes)[:-PUSH_HISTORY]:
                del self.pushes[old]

    def drop(self, version: int) -> None:
        self.pushes.pop(version, None)

    def ack(self, watcher: str, version: int, now: float) -> None:
        if watcher in self.streams and self.running.get(watcher, 0) != version:
            self.running[watcher] = version
            self._update_gauges()
        # acknowledging a version also acknowledges the older ones it skipped
        for number, push in list(self.pushes.items()):
            if number <= version and watcher in push.waiting:
                push.waiting.discard(watcher)
                push.acked += 1
                push.finished = now
                push.ack_seconds.append(now - push.started)
                self._maybe_finish(number, push)

    def status(self, version: int, stored: bool) -> pb.PushStatus:
        push = self.pushes.get(version)
        out = pb.PushStatus(version=version, connected_watchers=len(self.streams),
                            workers_per_version=self._workers_per_version())
        if push is None:
            out.complete = stored or version == 0
        else:
            out.watchers, out.acked, out.complete = push.expected, push.acked, push.complete
            out.published_unix = push.started_unix
            out.ack_seconds.extend(push.ack_seconds)
            if push.complete and push.acked:
                out.push_seconds = push.finished - push.started
                out.last_ack_unix = push.started_unix + out.push_seconds
        return out

    def _maybe_finish(self, version: int, push: Push) -> None:
        """Observe the push latency once every watcher of the push acknowledged (or left)."""
        if not push.complete or push.observed:
            return
        push.observed = True
        self.lock.notify_all()
        if push.acked:
            latency = push.finished - push.started
            PUSH_LATENCY.observe(latency)
            LAST_PUSH_LATENCY.set(latency)
            log.info("version %d reached %d/%d watchers in %.3fs (%d left)", version, push.acked, push.expected,
                     latency, len(push.watchers_left))

    def _workers_per_version(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for watcher in self.streams:
            version = self.running.get(watcher, 0)
            counts[version] = counts.get(version, 0) + 1
        return counts

    def _update_gauges(self) -> None:
        WATCHERS.set(len(self.streams))
        WORKERS_PER_VERSION.clear()
        for version, n in self._workers_per_version().items():
            WORKERS_PER_VERSION.labels(str(version)).set(n)
