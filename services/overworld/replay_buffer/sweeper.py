"""The orphan sweeper: deletes fragment blobs that no index entry references.

A front writes a fragment's blob before its index entry, so a crash between the two (or a blob whose
index entry was removed while its deferred delete was pending in a front that then died) leaves a
blob nobody references. The sweeper lists the run's blobs, keeps those younger than a grace period
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

from overworld.core.blobs import BlobStore
from overworld.replay_buffer.index import ReplayIndex

log = logging.getLogger("overworld.replay_buffer.sweeper")


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
