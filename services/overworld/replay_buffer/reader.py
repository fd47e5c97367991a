"""The reader: trainer ranks sampling chunks from the replay buffer, optionally ahead of the learner.

`sample_stream` runs one Sample call through a restart of the front: a stream that breaks keeps the
chunks it delivered (they were claimed, and count as sampled) and the reader asks for the rest; a call
that got nothing is retried with backoff. `sample_chunks` asks until it has all it wanted, each Sample
asking the front to wait up to `wait` seconds for chunks.

`ChunkReader`: `num_readers` Sample streams split each batch between them; `prefetch_batches` batches
are fetched ahead in the background (0: fetch when asked, which keeps the policy lag of on-policy runs
lowest). Every call has a deadline, and a reader that receives no chunk at all for `data_timeout`
seconds fails (`NoDataError`, naming what it waited for): nothing here waits forever. A reader told to
stop (`ChunkReader.stop_waiting`, the trainer's stop) returns what it holds within STOP_POLL_SECONDS.

When the buffer's blobs are in S3, chunks are sampled by reference: the front claims them and hands
out their blob keys, and the reader fetches the blobs from the store itself, in parallel threads
(`refs.BlobRefReader`), so that 3 MB payloads skip the front's gRPC hop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from overworld.core.grpc_util import Retry
from overworld.v1 import replay_buffer_pb2

if TYPE_CHECKING:
    from overworld.replay_buffer.refs import BlobRefReader

log = logging.getLogger("overworld.replay_buffer.reader")
STOP_POLL_SECONDS = 2.0  # a Sample call that may be stopped waits this long at most, then asks again


class SampleSource(Protocol):
    """What sampling needs of its ReplayBufferClient (declared here: the client imports this module)."""

    blob_refs: BlobRefReader

    def call(self, method: str, request: Any, *, timeout: float) -> Any: ...

    def stats(self, *, timeout: float = 10.0) -> replay_buffer_pb2.BufferStats: ...


class NoDataError(TimeoutError):
    """The replay buffer handed out no chunk for `train_config.data_timeout` seconds."""


def sample_stream(client: SampleSource, request: replay_buffer_pb2.SampleRequest, attempt: float,
                  timeout: float) -> list[replay_buffer_pb2.SampledChunk]:
    """The chunks of one Sample call (each attempt `attempt` seconds at most, all of them `timeout`). A
    stream that breaks after delivering chunks returns them (fewer than asked: ask again for the rest)."""
    got: list[replay_buffer_pb2.SampledChunk] = []

    def sample(left: float) -> None:
        try:
            for chunk in client.call("Sample", request, timeout=min(left, attempt)):
                got.append(chunk)
        except grpc.RpcError as err:
            if not got:
                raise
            log.warning("%s: Sample stream broke after %d of %d chunks (%s); asking again for the rest",
                        request.reader_id, len(got), request.num_chunks, err.code().name)

    Retry(timeout).run(sample, "Sample")
    return got


def _buffer_state(client: SampleSource) -> str:
    try:
        stats = client.stats(timeout=10.0)
    except Exception as err:  # the message must be written even when the buffer is gone
        return f"its statistics are unavailable ({err.__class__.__name__})"
    return (f"it holds {stats.chunks} chunks ({stats.fragments} fragments), has accepted "
            f"{stats.inserted_fragments} fragments in all, model version {stats.model_version}")


def sample_chunks(client: SampleSource, n: int, reader_id: str, wait: float, stop: threading.Event | None = None,
                  blob_refs: bool | None = None, data_timeout: float | None = None
                  ) -> list[replay_buffer_pb2.SampledChunk]:
    """n chunks (fewer only when stopped), with their fragments; each Sample call asks the front to wait
    up to `wait` seconds for chunks (and ends `wait` + 60 s later at most). blob_refs (None: when the buffer's
    blobs are in S3): the front hands out the claimed chunks' blob keys and the blobs are fetched from
    the store here; a chunk whose blob is gone is skipped and another one sampled in its place.
    data_timeout: raise NoDataError once no chunk has arrived for that many seconds."""
    chunks: list[replay_buffer_pb2.SampledChunk] = []
    last_data = time.monotonic()
    last_said = last_data - wait  # the first empty answer is said, then one every `wait` seconds
    poll = min(wait, STOP_POLL_SECONDS) if stop is not None else wait
    while len(chunks) < n and not (stop and stop.is_set()):
        store = client.blob_refs.store_for(blob_refs)
        held = poll if data_timeout is None else max(0.1, min(poll, last_data + data_timeout - time.monotonic()))
        request = replay_buffer_pb2.SampleRequest(num_chunks=n - len(chunks), timeout_seconds=held,
                                                  reader_id=reader_id, allow_partial=True,
                                                  blob_refs=store is not None)
        got = sample_stream(client, request, held + 30, held + 60)
        if not got and time.monotonic() - last_said >= wait:
            last_said = time.monotonic()
            log.info("%s waiting for data: %d of %d chunks", reader_id, len(chunks), n)
        elif got and store is not None:
            got = client.blob_refs.fetch(store, reader_id, got)
        if got:
            last_data = time.monotonic()
        elif data_timeout is not None and time.monotonic() - last_data >= data_timeout:
            raise NoDataError(
                f"{reader_id}: no chunk from the replay buffer for {time.monotonic() - last_data:.0f}s "
                f"(train_config.data_timeout={data_timeout:g}); waited for {n - len(chunks)} more of {n} chunks "
                f"of this rank's batch; {_buffer_state(client)}. Are rollout workers running and sending "
                "fragments (overworld status; rollout-worker logs)?")
        chunks += got
    return chunks


class ChunkReader:
    """Batches of `chunks_per_batch` sampled chunks, `next()` one at a time (made by
    `ReplayBufferClient.reader`)."""

    def __init__(self, client: SampleSource, chunks_per_batch: int, num_readers: int, prefetch_batches: int,
                 name: str, wait: float, data_timeout: float | None = None) -> None:
        self.client = client
        self.n = chunks_per_batch
        self.readers = max(1, min(num_readers, chunks_per_batch))
        self.wait = wait
        self.data_timeout = data_timeout
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
        parts = self.pool.map(lambda i: sample_chunks(self.client, shares[i], f"{self.name}-r{i}", self.wait,
                                                      self.stop, data_timeout=self.data_timeout), range(self.readers))
        return [c for part in parts for c in part]

    def _prefetch(self) -> None:
        assert self.queue is not None
        while not self.stop.is_set():
            batch: list[replay_buffer_pb2.SampledChunk] | Exception
            try:
                batch = self._fetch()
            except Exception as err:  # handed to next(): the learner fails instead of waiting forever
                batch = err
            while not self.stop.is_set():
                try:
                    self.queue.put(batch, timeout=0.5)
                    break
                except queue.Full:
                    continue
            if isinstance(batch, Exception):
                return

    def next(self) -> list[replay_buffer_pb2.SampledChunk]:
        """The next batch: `chunks_per_batch` chunks, fewer (maybe none) once told to stop waiting."""
        if self.queue is None:
            return self._fetch()
        while True:
            try:
                batch = self.queue.get(timeout=0.5)
                break
            except queue.Empty:
                if self.stop.is_set():
                    return []
        if isinstance(batch, Exception):
            self.stop.set()
            raise batch
        return batch

    def stop_waiting(self) -> None:
        """From another thread: the call waiting for chunks returns what it has (its claimed chunks count as
        sampled), and every later one returns at once."""
        self.stop.set()

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
