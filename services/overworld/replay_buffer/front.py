"""What a call (an Insert stream, ingest.py; a Sample stream, sampling.py) needs of the
ReplayBufferService that runs it: declared here, since the service imports the calls' modules."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from overworld.core.blobs.store import BlobStore
from overworld.replay_buffer.index import ReplayIndex
from overworld.replay_buffer.sweeper import DeferredDeletes


class Front(Protocol):
    blobs: BlobStore
    deletes: DeferredDeletes  # blobs of chunks that left the index, deleted after a grace period
    generation: int  # counts notify() calls: a waiter that read it before looking misses none
    index: ReplayIndex
    io: ThreadPoolExecutor  # blob reads and writes
    stopping: threading.Event

    def notify(self, *_: object) -> None: ...
    def wait_change(self, seen: int, timeout: float) -> None: ...
