"""The replay buffer's client, as Reverb's: one object per buffer with a writer and a reader.

    buffer = ReplayBufferClient("replay-buffer:50052")
    writer = buffer.writer(queue_size=64)                       # rollout workers: writer.put(fragment, stop)
    reader = buffer.reader(chunks_per_batch=32, num_readers=2, prefetch_batches=1, name="rank-0", wait=60.0)
    batch = reader.next()                                       # trainers: a batch of SampledChunk messages
    buffer.set_model_version(7)                                 # the learner's version (staleness drops)

The client owns its channel and, for readers that sample by reference, the blob store they fetch
from, its fetch threads and its read buffers (`refs.BlobRefReader`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import grpc

from overworld.core.client import ServiceClient
from overworld.core.grpc_util import Retry, channel
from overworld.replay_buffer.reader import ChunkReader, sample_chunks
from overworld.replay_buffer.refs import BlobRefReader
from overworld.replay_buffer.reservations import Reservations
from overworld.replay_buffer.writer import FragmentWriter
from overworld.v1 import replay_buffer_pb2, replay_buffer_pb2_grpc


class ReplayBufferClient(ServiceClient):
    def __init__(self, address: str, *, channel: grpc.Channel | None = None) -> None:
        super().__init__(address, replay_buffer_pb2_grpc.ReplayBufferStub, "replay-buffer", channel=channel)
        self.blob_refs = BlobRefReader(lambda: self.store_info(timeout=10.0))

    # ----------------------------------------------------------------- writer

    def writer(self, queue_size: int, ack_log: str | None = None) -> FragmentWriter:
        """A writer that streams fragments to the buffer (`put`, `depth`, `close`): at most `queue_size`
        queued or unacknowledged, resent after a reconnect; `ack_log`: a file every acknowledgement is
        appended to (fsynced)."""
        return FragmentWriter(self, queue_size, ack_log)

    def insert(self, requests: Iterator[replay_buffer_pb2.InsertRequest], *, timeout: float | None = None
               ) -> Iterator[replay_buffer_pb2.InsertResponse]:
        """One Insert stream: an acknowledgement per fragment, in order; one attempt (a writer resends
        what was not acknowledged). `timeout` None: no deadline, a writer's stream lives as long as it
        has fragments to send. A client that opened its own channel runs each stream on a connection of
        its own, closed when it ends: a stream that broke starts over on a fresh one (a channel given to
        the constructor carries every stream)."""
        if not self._owns_channel:
            yield from self._stub.Insert(requests, timeout=timeout)
            return
        with channel(self.address, "replay-buffer") as insert_channel:
            yield from replay_buffer_pb2_grpc.ReplayBufferStub(insert_channel).Insert(requests, timeout=timeout)

    def reserve(self, worker_id: str, fragments: int, *, starting: int = 0, wait: float = 0.0, give_back: int = 0,
                timeout: float = 10.0) -> replay_buffer_pb2.ReserveResponse:
        """Room for up to `fragments` fragments of `worker_id`, of which `starting` would begin an episode
        (the buffer waits up to `wait` seconds for some), after giving back `give_back`; one attempt
        (`timeout` > `wait`). Workers use `reservations()`."""
        request = replay_buffer_pb2.ReserveRequest(worker_id=worker_id, fragments=fragments, starting=starting,
                                                   wait_seconds=wait, give_back=give_back)
        return self._stub.Reserve(request, timeout=timeout)

    def reservations(self, worker_id: str, on_room: Callable[[], None] | None = None) -> Reservations:
        """Room reserved ahead for the fragments of `worker_id` (`want`, `take`, `close`); `on_room` is
        called when room arrives."""
        return Reservations(self, worker_id, on_room)

    # ----------------------------------------------------------------- reader

    def reader(self, chunks_per_batch: int, num_readers: int, prefetch_batches: int, name: str, *, wait: float,
               data_timeout: float | None = None) -> ChunkReader:
        """Batches of `chunks_per_batch` chunks (`next()`, `close()`), sampled by `num_readers` streams,
        `prefetch_batches` fetched ahead; each Sample call asks the buffer to wait up to `wait` seconds for
        chunks, and no chunk for `data_timeout` seconds raises NoDataError. `name` prefixes the reader ids
        (`{name}-r{i}`)."""
        return ChunkReader(self, chunks_per_batch, num_readers, prefetch_batches, name, wait, data_timeout)

    def sample(self, n: int, reader_id: str, *, wait: float, stop: threading.Event | None = None,
               blob_refs: bool | None = None, data_timeout: float | None = None
               ) -> list[replay_buffer_pb2.SampledChunk]:
        """n chunks with their fragments (fewer only when `stop` is set), each Sample call retried through
        a restart of the front: `reader.sample_chunks`. There is no `timeout`: it asks until it has them,
        or raises NoDataError once no chunk has come for `data_timeout` seconds."""
        return sample_chunks(self, n, reader_id, wait, stop, blob_refs, data_timeout)

    def store_info(self, *, timeout: float = 10.0) -> replay_buffer_pb2.StoreInfo:
        """Where the buffer's blobs are (readers sampling by reference fetch them there) and how long
        they stay after their chunk leaves. One attempt (readers sample in-band meanwhile)."""
        return self._stub.GetStoreInfo(replay_buffer_pb2.GetStoreInfoRequest(), timeout=timeout)

    # ----------------------------------------------------------------- control and statistics

    def set_model_version(self, version: int, *, timeout: float = 60.0) -> replay_buffer_pb2.SetModelVersionResponse:
        """The learner's model version (chunks older than max_staleness behind it are dropped). Retried
        (30 s attempts) through a restart of the front; FAILED_PRECONDITION if it goes back."""
        request = replay_buffer_pb2.SetModelVersionRequest(model_version=version)
        return Retry(timeout, attempt=30).unary(self._stub.SetModelVersion, request, "SetModelVersion")

    def stats(self, *, timeout: float = 10.0) -> replay_buffer_pb2.BufferStats:
        """The buffer-wide counters. Retried (through a front restarting)."""
        return Retry(timeout).unary(self._stub.GetStats, replay_buffer_pb2.GetStatsRequest(), "GetStats")

    def close(self) -> None:
        """Stop the blob fetch threads and close the channel this client opened (its readers stop working;
        a writer opens a channel of its own for each stream and must be closed apart)."""
        self.blob_refs.close()
        super().close()
