"""Deleting blobs: the deferred deletes of chunks that left the index, and the orphan sweeper.

Blobs of chunks that leave the index are deleted after `delete_delay` seconds, so that a reader that
claimed a chunk just before it left can still read it; while claims by reference are being made (any
front's: the index remembers the last one, and every front asks it more often than delete_delay),
after `ref_grace` seconds instead, so that a reader handed the keys can still fetch them
(`DeferredDeletes`).

The orphan sweeper deletes fragment blobs that no index entry references. A front writes a
fragment's blob before its index entry, so a crash between the two (or a blob whose index entry was
removed while its deferred delete was pending in a front that then died) leaves a blob nobody
references. The sweeper lists the run's blobs, keeps those younger than a grace period
(a front may still be about to index them), and asks the index which of the rest are unreferenced.
The index answers and tombstones those keys in one atomic step, and refuses to index a tombstoned
key afterwards, so a slow front can never create an index entry whose blob was swept: it writes the
blob again under a new key instead. Every front runs a sweeper; running several is safe.

A blob's age says when it was written, not when its chunk left the index: a chunk written long ago
and claimed for the last time a moment ago is unreferenced at once, while a reader that was handed
its blob keys (`SampleRequest.blob_refs`) is still about to fetch them. So a key is swept only once
it has been seen unreferenced for `ref_grace_seconds` (across sweeps: the first sweep that sees it
unreferenced notes the time, a later one sweeps it). Whenever it left the index, it left no later
than that first sighting, so every reader keeps at least the grace to fetch it. The notes live in
this sweeper only; a restarted sweeper starts over, which delays a sweep and never hastens one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from overworld.core.blobs.store import BlobStore
from overworld.replay_buffer.index import ReplayIndex

log = logging.getLogger("overworld.replay_buffer.sweeper")
POLL_SECONDS = 0.05  # other fronts' changes to a shared (Redis) index are seen by polling it


class DeferredDeletes:
    """Deletes blobs that the index no longer references (their chunk left it): after delete_delay (a
    reader that claimed the chunk just before it left still reads it), or after ref_grace when claims
    by reference may have been made (such a reader fetches the blobs itself, later)."""

    def __init__(self, index: ReplayIndex, blobs: BlobStore, delete_delay: float, ref_grace: float,
                 wake: Callable[[], None]) -> None:
        self.index = index
        self.blobs = blobs
        self.delete_delay = delete_delay
        self.ref_grace = ref_grace
        self._wake = wake  # the housekeeping thread, which runs the deletes as they come due
        # How often the index is asked about the last claim by reference (more often than delete_delay, so
        # that a delete that comes due has normally seen every such claim made before its chunk left; a
        # delete waits for such a poll in any case).
        self.poll_interval = max(POLL_SECONDS, min(0.5, delete_delay / 2)) if ref_grace > delete_delay else 0.0
        self._refs_until = 0.0  # (monotonic) a claim by reference may be recent until then
        self._refs_polled = float("-inf")  # (monotonic) when the last successful poll started
        self._deletes: deque[tuple[float, list[str]]] = deque()  # (when they left the index, keys)
        self._postponed: deque[tuple[float, list[str]]] = deque()  # the same, waiting out the ref grace
        self._lock = threading.Lock()

    def later(self, keys: list[str]) -> None:
        if keys:
            with self._lock:
                self._deletes.append((time.monotonic(), keys))
            self._wake()

    def note_ref_claim(self) -> None:
        with self._lock:
            self._refs_until = max(self._refs_until, time.monotonic() + self.ref_grace)

    def poll_refs(self) -> None:
        started = time.monotonic()
        age = self.index.ref_claim_age()
        with self._lock:
            if age is not None and age < self.ref_grace:
                # (measured after the answer: the claim is placed no earlier than it was)
                self._refs_until = max(self._refs_until, time.monotonic() - age + self.ref_grace)
            self._refs_polled = started

    def run_due(self) -> None:
        now = time.monotonic()
        due: list[str] = []
        with self._lock:
            while self._deletes and self._deletes[0][0] + self.delete_delay <= now:
                left, keys = self._deletes[0]
                if self.ref_grace > self.delete_delay and left + self.ref_grace > now:
                    if self._refs_until > now:  # a claim by reference may have handed these keys out
                        self._postponed.append(self._deletes.popleft())
                        continue
                    if self._refs_polled <= left:  # not known yet: wait for a poll that started after
                        break
                due += self._deletes.popleft()[1]
            while self._postponed and self._postponed[0][0] + self.ref_grace <= now:
                due += self._postponed.popleft()[1]
        if due:
            try:
                self.blobs.delete(due)
            except Exception:  # the sweeper removes them later: nothing references them
                log.exception("deleting %d blobs failed; the orphan sweeper will retry", len(due))

    def next_due(self) -> float:
        """When the oldest queued delete comes due; one overdue but held back (it waits for a poll for
        claims by reference) is looked at again POLL_SECONDS later."""
        with self._lock:
            due = [self._deletes[0][0] + self.delete_delay] if self._deletes else []
            due += [self._postponed[0][0] + self.ref_grace] if self._postponed else []
        return max(min(due, default=float("inf")), time.monotonic() + POLL_SECONDS)

    def waiting(self) -> int:
        """How many blobs are queued, not yet due."""
        with self._lock:
            return sum(len(keys) for _, keys in (*self._deletes, *self._postponed))


class OrphanSweeper:
    def __init__(self, index: ReplayIndex, blobs: BlobStore, prefix: str, grace_seconds: float,
                 ref_grace_seconds: float = 0.0) -> None:
        self.index = index
        self.blobs = blobs
        self.prefix = prefix
        self.grace_seconds = grace_seconds
        self.ref_grace_seconds = ref_grace_seconds
        self._unreferenced_since: dict[str, float] = {}
        self._lock = threading.Lock()

    def sweep(self, now: float | None = None) -> list[str]:
        """Delete orphaned blobs older than the grace period (and unreferenced for the ref grace);
        returns their keys."""
        with self._lock:
            now = time.time() if now is None else now
            candidates = [b.key for b in self.blobs.list_blobs(self.prefix) if b.modified <= now - self.grace_seconds]
            if candidates and self.ref_grace_seconds > 0:
                seen = self._unreferenced_since
                # Keys indexed meanwhile (a front stalled between blob write and index add) or gone are forgotten.
                self._unreferenced_since = {k: seen.get(k, now) for k in self.index.unreferenced(candidates)}
                candidates = [k for k, since in self._unreferenced_since.items()
                              if since <= now - self.ref_grace_seconds]
            elif not candidates:
                self._unreferenced_since = {}
            if not candidates:
                return []
            orphans = self.index.claim_orphans(candidates)
            if orphans:
                self.blobs.delete(orphans)
                for k in orphans:
                    self._unreferenced_since.pop(k, None)
                log.info("swept %d orphaned blobs under %s", len(orphans), self.prefix)
            return orphans
