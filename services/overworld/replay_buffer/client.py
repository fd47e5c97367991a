"""The replay buffer's client, as Reverb's: one object per buffer with a writer and a reader.

    buffer = ReplayBufferClient("replay-buffer:50052")
    writer = buffer.writer(queue_size=64)                       # rollout workers: writer.put(fragment, stop)
    reader = buffer.reader(chunks_per_batch=32, num_readers=2, prefetch_batches=1, timeout=60.0, name="rank-0")
    batch = reader.next()                                       # trainers: a batch of SampledChunk messages
    buffer.set_model_version(7)                                 # the learner's version (staleness drops)

The client owns its channel and, for readers that sample by reference, the blob store they fetch
from, its fetch threads and its read buffers (`refs.BlobRefReader`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from types import TracebackType

import grpc

from overworld.core.grpc_util import Retry, channel
from overworld.replay_buffer.reader import ChunkReader, sample_chunks
from overworld.replay_buffer.refs import BlobRefReader
from overworld.replay_buffer.reservations import Reservations
from overworld.replay_buffer.writer import FragmentWriter
from overworld.v1 import replay_buffer_pb2, replay_buffer_pb2_grpc


class ReplayBufferClient:
    def __init__(self, target: str | replay_buffer_pb2_grpc.ReplayBufferStub) -> None:
        """target: the buffer's address (the client opens a channel to it, closed by `close`), or a stub made
        elsewhere, whose channel stays its maker's."""
        self._channel: grpc.Channel | None = None
        if isinstance(target, str):
            self.address: str | None = target
            self._channel = channel(target)
            self.stub = replay_buffer_pb2_grpc.ReplayBufferStub(self._channel)
        else:
            self.address = None
            self.stub = target
        self.blob_refs = BlobRefReader(self.stub)

    # ----------------------------------------------------------------- writer

    def writer(self, queue_size: int, ack_log: str | None = None) -> FragmentWriter:
        """A writer that streams fragments to the buffer (`put`, `depth`, `close`): at most `queue_size`
        queued or unacknowledged, resent after a reconnect; `ack_log`: a file every acknowledgement is
        appended to (fsynced)."""
        return FragmentWriter(self, queue_size, ack_log)

    def insert(self, requests: Iterator[replay_buffer_pb2.InsertRequest]
               ) -> Iterator[replay_buffer_pb2.InsertResponse]:
        """One Insert stream: an acknowledgement per fragment, in order. With an address, each stream runs
        on a connection of its own, closed when it ends: a stream that broke starts over on a fresh one."""
        if self.address is None:
            yield from self.stub.Insert(requests)
            return
        with channel(self.address) as insert_channel:
            yield from replay_buffer_pb2_grpc.ReplayBufferStub(insert_channel).Insert(requests)

    def reserve(self, worker_id: str, fragments: int, wait: float = 0.0, give_back: int = 0,
                timeout: float = 10.0) -> replay_buffer_pb2.ReserveResponse:
        """Room for up to `fragments` fragments of `worker_id` (waiting up to `wait` seconds for some),
        after giving back `give_back`; one attempt. Workers use `reservations()`."""
        request = replay_buffer_pb2.ReserveRequest(worker_id=worker_id, fragments=fragments, wait_seconds=wait,
                                                   give_back=give_back)
        return self.stub.Reserve(request, timeout=timeout)

    def reservations(self, worker_id: str, on_room: Callable[[], None] | None = None) -> Reservations:
        """Room reserved ahead for the fragments of `worker_id` (`want`, `take`, `close`); `on_room` is
        called when room arrives."""
        return Reservations(self, worker_id, on_room)

    # ----------------------------------------------------------------- reader

    def reader(self, chunks_per_batch: int, num_readers: int, prefetch_batches: int, timeout: float, name: str,
               data_timeout: float | None = None) -> ChunkReader:
        """Batches of `chunks_per_batch` chunks (`next()`, `close()`), sampled by `num_readers` streams,
        `prefetch_batches` fetched ahead; each Sample call waits `timeout` seconds at most, and no chunk for
        `data_timeout` seconds raises NoDataError. `name` prefixes the reader ids (`{name}-r{i}`)."""
        return ChunkReader(self, chunks_per_batch, num_readers, prefetch_batches, timeout, name, data_timeout)

    def sample(self, n: int, timeout: float, reader_id: str, stop: threading.Event | None = None,
               blob_refs: bool | None = None, data_timeout: float | None = None) -> list[replay_buffer_pb2.SampledChunk]:
        """n chunks with their fragments (fewer only when `stop` is set): `reader.sample_chunks`."""
        return sample_chunks(self, n, timeout, reader_id, stop, blob_refs, data_timeout)

    # ----------------------------------------------------------------- control and statistics

    def set_model_version(self, version: int, deadline: float = 60.0) -> replay_buffer_pb2.SetModelVersionResponse:
        """The learner's model version (chunks older than max_staleness behind it are dropped), retried
        through a restart of the front for up to `deadline` seconds; FAILED_PRECONDITION if it goes back."""
        request = replay_buffer_pb2.SetModelVersionRequest(model_version=version)
        return Retry(deadline, attempt=30).unary(self.stub.SetModelVersion, request, "SetModelVersion")

    def stats(self, timeout: float = 10.0, *, retried: bool = False) -> replay_buffer_pb2.BufferStats:
        """The buffer-wide counters. retried: transient errors (a front restarting) are retried until
        `timeout` has passed; otherwise one attempt."""
        request = replay_buffer_pb2.GetStatsRequest()
        if retried:
            return Retry(timeout).unary(self.stub.GetStats, request, "GetStats")
        return self.stub.GetStats(request, timeout=timeout)

    def close(self) -> None:
        """Stop the blob fetch threads and close the channel this client opened (its readers stop working;
        a writer opens a channel of its own for each stream and must be closed apart)."""
        self.blob_refs.close()
        if self._channel is not None:
            self._channel.close()

    def __enter__(self) -> ReplayBufferClient:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
