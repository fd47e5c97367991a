"""Readers that sample chunks from the replay buffer, optionally ahead of the learner.

`num_readers` Sample streams split each batch between them; `prefetch_batches` batches are fetched
ahead in the background (0: fetch when asked, which keeps the policy lag of on-policy runs lowest).
Every call has a deadline: nothing here waits forever.

When the buffer's blobs are in S3, chunks are sampled by reference: the front claims them and hands
out their blob keys, and the reader fetches the blobs from the store itself, in parallel threads
(`sample_chunks`, through overworld.replay_buffer.client), so that 3 MB payloads skip the front's
gRPC hop.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

from overworld.replay_buffer.client import blob_store_for, fetch_chunks, sample_stream
from overworld.v1 import replay_buffer_pb2, replay_buffer_pb2_grpc

log = logging.getLogger("overworld.trainer")


def sample_chunks(stub: replay_buffer_pb2_grpc.ReplayBufferStub, n: int, timeout: float, reader_id: str,
                  stop: threading.Event | None = None, blob_refs: bool | None = None
                  ) -> list[replay_buffer_pb2.SampledChunk]:
    """n chunks (fewer only when stopped), with their fragments. blob_refs (None: when the buffer's
    blobs are in S3): the front hands out the claimed chunks' blob keys and the blobs are fetched from
    the store here; a chunk whose blob is gone is skipped and another one sampled in its place."""
    chunks: list[replay_buffer_pb2.SampledChunk] = []
    while len(chunks) < n and not (stop and stop.is_set()):
        store = blob_store_for(stub, blob_refs)
        request = replay_buffer_pb2.SampleRequest(num_chunks=n - len(chunks), timeout_seconds=timeout,
                                                  reader_id=reader_id, allow_partial=True,
                                                  blob_refs=store is not None)
        got = sample_stream(stub, request, timeout + 30, timeout + 60)
        if not got:
            log.info("%s waiting for data: %d of %d chunks", reader_id, len(chunks), n)
        elif store is not None:
            got = fetch_chunks(stub, store, reader_id, got)
        chunks += got
    return chunks


class ChunkReader:
    def __init__(self, stub: replay_buffer_pb2_grpc.ReplayBufferStub, chunks_per_batch: int, num_readers: int,
                 prefetch_batches: int, timeout: float, name: str) -> None:
        self.stub = stub
        self.n = chunks_per_batch
        self.readers = max(1, min(num_readers, chunks_per_batch))
        self.timeout = timeout
        self.name = name
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(self.readers, thread_name_prefix="reader")
        self.queue: queue.Queue | None = None
        if prefetch_batches > 0:
            self.queue = queue.Queue(maxsize=prefetch_batches)
            self.thread = threading.Thread(target=self._prefetch, name="prefetch", daemon=True)
            self.thread.start()

    def _fetch(self) -> list[replay_buffer_pb2.SampledChunk]:
        shares = [self.n // self.readers + (i < self.n % self.readers) for i in range(self.readers)]
        parts = self.pool.map(lambda i: sample_chunks(self.stub, shares[i], self.timeout, f"{self.name}-r{i}",
                                                      self.stop), range(self.readers))
        return [c for part in parts for c in part]

    def _prefetch(self) -> None:
        assert self.queue is not None
        while not self.stop.is_set():
            try:
                batch: list | Exception = self._fetch()
            except Exception as err:  # the buffer stayed away past the deadline: the learner raises it
                batch = err
            while not self.stop.is_set():
                try:
                    self.queue.put(batch, timeout=0.5)
                    break
                except queue.Full:
                    continue

    def next(self) -> list[replay_buffer_pb2.SampledChunk]:
        if self.queue is None:
            return self._fetch()
        batch = self.queue.get()
        if isinstance(batch, Exception):
            raise batch
        return batch

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
