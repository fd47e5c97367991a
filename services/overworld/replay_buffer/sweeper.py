"""The orphan sweeper: deletes fragment blobs that no index entry references.

A front writes a fragment's blob before its index entry, so a crash between the two (or a blob whose
index entry was removed while its deferred delete was pending in a front that then died) leaves a
blob nobody references. The sweeper lists the run's blobs, keeps those younger than a grace period
(a front may still be about to index them), and asks the index which of the rest are unreferenced.
The index answers and tombstones those keys in one atomic step, and refuses to index a tombstoned
key afterwards, so a slow front can never create an index entry whose blob was swept: it writes the
blob again under a new key instead. Every front runs a sweeper; running several is safe.
"""

from __future__ import annotations

import logging
import time

from overworld.core.blobs import BlobStore
from overworld.replay_buffer.index import ReplayIndex

log = logging.getLogger("overworld.replay_buffer.sweeper")


class OrphanSweeper:
    def __init__(self, index: ReplayIndex, blobs: BlobStore, prefix: str, grace_seconds: float) -> None:
        self.index = index
        self.blobs = blobs
        self.prefix = prefix
        self.grace_seconds = grace_seconds

    def sweep(self, now: float | None = None) -> list[str]:
        """Delete orphaned blobs older than the grace period; returns their keys."""
        now = time.time() if now is None else now
        candidates = [b.key for b in self.blobs.list_blobs(self.prefix) if b.modified <= now - self.grace_seconds]
        if not candidates:
            return []
        orphans = self.index.claim_orphans(candidates)
        if orphans:
            self.blobs.delete(orphans)
            log.info("swept %d orphaned blobs under %s", len(orphans), self.prefix)
        return orphans
