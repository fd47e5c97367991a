"""The replay-buffer gRPC front: the service, its housekeeping, version moves and statistics.

Fronts are stateless: everything they know lives in the index and the blob store, so several
fronts can serve one run, and a front killed at any moment loses nothing it acknowledged.

Ingest (Insert, bidi-streaming; `ingest.py`): each fragment is validated, its blob written, then its
index entry added, and only then acknowledged. Blob writes of one stream run in parallel (up to
`ingest_window` in flight), index adds and acks stay in arrival order, and the stream stops reading
while the window is full or the rate limiter blocks: that is the backpressure a worker feels.

Reserve (unary): a worker that holds a lease at the rollout-manager (`leases.py`) reserves room for
the fragments it is about to step; the index counts reserved room as inserted for the rate limiter, so a
fleet steps only what will be admitted (and sampled while fresh), and a worker's fragments take their
room without waiting at the door. The room of a worker whose lease is gone goes back. A call that waits
for room holds a server thread: at most `max_waiting_reserves` wait at once, and one more that would
wait is refused (RESOURCE_EXHAUSTED) rather than starving the thread pool.

Sample (server-streaming; `sampling.py`): chunks are claimed (atomically, in the index) at most
`prefetch` ahead of what was sent, and their blobs fetched in parallel while earlier chunks are being
streamed. With `SampleRequest.blob_refs` the front sends each claimed chunk's blob keys instead, and
the reader fetches the blobs from the store itself (`GetStoreInfo` names it): the 3 MB payloads then
skip the front's gRPC hop, while the claim — reuse counting, rate limiter, deadline — stays the front's.

Blobs of chunks that leave the index are deleted after `delete_delay` seconds, so that a reader that
claimed a chunk just before it left can still read it; while claims by reference are being made (any
front's: the index remembers the last one, and every front asks it more often than delete_delay),
after `ref_grace` seconds instead, so that a reader handed the keys can still fetch them. Blobs
nobody references (a front died between blob write and index add, or before its deferred deletes
ran) are removed by the orphan sweeper, which also spares a key for `ref_grace` after it first saw it
unreferenced (`sweeper.py`: both).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from overworld.core.blobs.store import BlobStore
from overworld.core.grpc_util import Refused
from overworld.core.specs import Spaces
from overworld.replay_buffer.index import IndexStats, IndexUnavailable, MemoryIndex, ReplayIndex
from overworld.replay_buffer.ingest import InsertReport, InsertStream, fragments_prefix
from overworld.replay_buffer.leases import Leases
from overworld.replay_buffer.metrics import (
    BYTES,
    CAPACITY,
    DROPS,
    FRAGMENTS,
    MEAN_REUSE,
    ORPHANS,
    RESERVED,
    RESERVED_NOW,
    STALENESS,
    rejects_by_reason,
)
from overworld.replay_buffer.sampling import SampleStream, check_sample_request
from overworld.replay_buffer.sweeper import POLL_SECONDS, DeferredDeletes, OrphanSweeper
from overworld.v1 import replay_buffer_pb2, replay_buffer_pb2_grpc

__all__ = ["InsertReport", "ReplayBufferService", "add_to_server", "fragments_prefix"]

log = logging.getLogger("overworld.replay_buffer")

SERVICE_NAME = "overworld.v1.ReplayBuffer"
MAX_RESERVE_FRAGMENTS = 65536
MAX_RESERVE_WAIT = 60.0


def check_reserve_request(request: replay_buffer_pb2.ReserveRequest) -> str | None:
    """What is wrong with a Reserve request, or None."""
    if not request.worker_id or len(request.worker_id) > 256:
        return f"worker_id must be 1 to 256 characters (the worker_id of its fragments), got {len(request.worker_id)}"
    if request.fragments > MAX_RESERVE_FRAGMENTS or request.give_back > MAX_RESERVE_FRAGMENTS:
        return (f"fragments and give_back must be at most {MAX_RESERVE_FRAGMENTS}, got {request.fragments} and "
                f"{request.give_back}")
    if request.starting > request.fragments:
        return (f"starting must be at most fragments (it counts those of them that would begin an episode), got "
                f"{request.starting} > {request.fragments}")
    if not 0 <= request.wait_seconds <= MAX_RESERVE_WAIT:  # also NaN
        return f"wait_seconds must be in [0, {MAX_RESERVE_WAIT:g}], got {request.wait_seconds}"
    return None


class ReplayBufferService(replay_buffer_pb2_grpc.ReplayBufferServicer):
    def __init__(self, index: ReplayIndex, blobs: BlobStore, run_id: str, fragment_length: int,
                 fragments_per_chunk: int, max_chunks: int, spaces: Callable[[], Spaces | None],
                 max_fragment_bytes: int = 64 * 1024 * 1024, default_sample_timeout: float = 60.0, *,
                 ingest_window: int = 4, prefetch: int = 4, io_threads: int = 16, delete_delay: float = 2.0,
                 sweep_interval: float = 60.0, orphan_grace: float = 600.0, metrics_interval: float = 2.0,
                 ref_grace: float = 60.0, store_url: str | None = None, fragments_per_report: int = 0,
                 reservation_ttl: float = 60.0, leases: Leases | None = None, max_waiting_reserves: int = 128,
                 reservations: bool = True) -> None:
        """`leases`: the fleet's leases (the rollout-manager's); room is reserved only for their holders.
        None: for any worker id (a buffer without a fleet: tests, benchmarks of the buffer alone).
        `reservations` False: Reserve answers that reserving is not needed (workers step unthrottled and
        their fragments meet the rate limiter at the door), replay_buffer_config.reservations."""
        self.index = index
        self.report = InsertReport(fragments_per_report, index)
        self.blobs = blobs
        self.run_id = run_id
        self.fragment_length = fragment_length
        self.max_chunks = max_chunks
        self.spaces = spaces
        self.max_fragment_bytes = max_fragment_bytes
        self.default_sample_timeout = default_sample_timeout
        self.ingest_window = max(1, ingest_window)
        self.prefetch = max(1, prefetch)
        self.delete_delay = delete_delay
        # blob_refs readers fetch blobs themselves after the claim: while such claims are being made (by
        # any front: the index remembers the last one), blobs of chunks that left the index are kept this
        # long, and the sweeper spares them as long, so that such a fetch finds them.
        self.ref_grace = max(0.0, ref_grace)
        self.reservation_ttl = reservation_ttl
        self.leases = leases
        self.reservations = reservations
        self.max_waiting_reserves = max_waiting_reserves
        self._waiting_reserves = threading.BoundedSemaphore(max(1, max_waiting_reserves))
        self.store_url = getattr(blobs, "url", "") if store_url is None else store_url
        self.sweep_interval = sweep_interval
        self.metrics_interval = metrics_interval
        self.prefix = fragments_prefix(run_id)
        self.sweeper = OrphanSweeper(index, blobs, self.prefix, orphan_grace, self.ref_grace)
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="rb-io")
        self._changed = threading.Condition()
        self.generation = 0  # counts notify() calls: a waiter that read it before looking misses none
        self._shared_index = not isinstance(index, MemoryIndex)
        self.stopping = threading.Event()
        self._maintenance_wake = threading.Event()
        self.deletes = DeferredDeletes(index, blobs, delete_delay, self.ref_grace, self._maintenance_wake.set)
        self._maintenance = threading.Thread(target=self._maintain, name="rb-maintenance", daemon=True)
        CAPACITY.set(max_chunks * fragments_per_chunk)
        self._maintenance.start()

    # ----------------------------------------------------------------- lifecycle and housekeeping

    def stop(self) -> None:
        """Stop serving (in-flight calls end with UNAVAILABLE) and run the blob deletes that are due.
        Blobs still within their grace period are left to the orphan sweeper (any front's): a reader
        handed their keys by this front may still be fetching them."""
        self.stopping.set()
        self._maintenance_wake.set()
        self.notify()
        self._maintenance.join(10.0)
        self.deletes.run_due()
        left = self.deletes.waiting()
        if left:
            log.info("%d blobs of chunks that left the buffer are within their grace period; the orphan "
                     "sweeper deletes them later", left)
        self.io.shutdown(wait=False)  # queued writes and reads finish; handlers deliver them in the grace period

    def discard_buffered(self, token: str | None = None) -> int:
        """Discard this run's buffered data (keep_on_resume: false). With a token, only the first call
        with that token discards, so that several fronts starting for one attempt clear it once.
        Returns the number of blobs deleted."""
        keys = self.index.reset(token)
        if not keys:
            return 0
        self.blobs.delete(keys)
        log.info("discarded the buffered data of run %s (%d blobs)", self.run_id, len(keys))
        return len(keys)

    def notify(self, *_: object) -> None:
        """Wake the calls waiting for a change (this front changed the index, or a call ended)."""
        with self._changed:
            self.generation += 1
            self._changed.notify_all()

    def wait_change(self, seen: int, timeout: float) -> None:
        """Until this front changes something after `seen` (its `generation` read before the caller
        looked), a call ends (their handlers notify), or `timeout`. An in-process index changes only here:
        nothing to poll. A shared index also changes by other fronts: polled every POLL_SECONDS."""
        if self._shared_index:
            timeout = min(timeout, POLL_SECONDS)
        with self._changed:
            self._changed.wait_for(lambda: self.generation != seen, max(0.0, timeout))

    def _maintain(self) -> None:
        """Sleeps until the next thing is due (a blob delete, a poll for claims by reference, metrics, the
        sweep); a new delete wakes it (`DeferredDeletes.later`), so does stop()."""
        never = float("inf")
        refs_poll = self.deletes.poll_interval
        leases_poll = self.leases.refresh_seconds if self.leases is not None else 0.0
        next_metrics = next_sweep = next_poll = next_leases = time.monotonic()
        if self.sweep_interval > 0:
            next_sweep += self.sweep_interval
        while True:
            wake_at = min(next_poll if refs_poll else never, next_metrics if self.metrics_interval > 0 else never,
                          next_sweep if self.sweep_interval > 0 else never, self.deletes.next_due(),
                          next_leases if leases_poll else never)
            self._maintenance_wake.wait(None if wake_at == never else max(0.0, wake_at - time.monotonic()))
            self._maintenance_wake.clear()
            if self.stopping.is_set():
                return
            now = time.monotonic()
            if refs_poll and now >= next_poll:
                next_poll = now + refs_poll
                try:
                    self.deletes.poll_refs()
                except IndexUnavailable as err:  # deletes wait (at most the ref grace) for a poll
                    log.warning("checking for claims by reference failed: %s", err)
                except Exception:
                    log.exception("checking for claims by reference failed")
            self.deletes.run_due()
            try:
                if leases_poll and now >= next_leases:
                    next_leases = now + leases_poll
                    self.forget_lapsed_holders()
                if self.metrics_interval > 0 and now >= next_metrics:
                    next_metrics = now + self.metrics_interval
                    self.refresh_metrics()
                if self.sweep_interval > 0 and now >= next_sweep:
                    next_sweep = now + self.sweep_interval
                    self.sweep_orphans()
            except IndexUnavailable as err:
                log.warning("housekeeping skipped: %s", err)
            except Exception:
                log.exception("housekeeping failed")

    def sweep_orphans(self) -> list[str]:
        swept = self.sweeper.sweep()
        ORPHANS.inc(len(swept))
        return swept

    # ----------------------------------------------------------------- ingest and sample

    def Insert(self, request_iterator: Iterator[replay_buffer_pb2.InsertRequest],
               context: grpc.ServicerContext) -> Iterator[replay_buffer_pb2.InsertResponse]:
        """Insert as registered by the generated code (parsed messages); `add_to_server` skips the parse."""
        return self.insert_raw((r.SerializeToString() for r in request_iterator), context)

    def insert_raw(self, request_iterator: Iterator[bytes],
                   context: grpc.ServicerContext) -> Iterator[replay_buffer_pb2.InsertResponse]:
        context.add_callback(self.notify)  # an insert blocked by the rate limiter wakes when its call ends
        yield from InsertStream(self, request_iterator, context).responses()

    def Sample(self, request: replay_buffer_pb2.SampleRequest,
               context: grpc.ServicerContext) -> Iterator[replay_buffer_pb2.SampledChunk]:
        """Sample as registered by the generated code (messages); `add_to_server` sends the bytes as they are."""
        for raw in self.sample_raw(request, context):
            yield replay_buffer_pb2.SampledChunk.FromString(raw)

    def sample_raw(self, request: replay_buffer_pb2.SampleRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        check_sample_request(request, context, self.max_chunks, self.default_sample_timeout)
        context.add_callback(self.notify)  # a waiting sample wakes when its call ends
        stream = SampleStream(self, request, context)
        try:
            yield from stream.chunks()
        finally:
            stream.release_unsent()

    def Reserve(self, request: replay_buffer_pb2.ReserveRequest,
                context: grpc.ServicerContext) -> replay_buffer_pb2.ReserveResponse:
        """Room for up to `fragments` fragments of `worker_id`, waiting up to `wait_seconds` for some;
        `give_back` returns room first."""
        problem = check_reserve_request(request)
        if problem:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, problem)
        limited = self.reservations and self.index.limiter is not None
        if not limited:
            return replay_buffer_pb2.ReserveResponse(granted=request.fragments, limited=False)
        deadline = time.monotonic() + request.wait_seconds
        waiting = False
        try:
            if request.give_back:
                self.index.release(request.worker_id, request.give_back)
                self.notify()  # room for the other workers waiting here
            if request.fragments and self.leases is not None and not self.leases.holds(request.worker_id):
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {request.worker_id} holds no lease at the rollout-manager: room is reserved "
                              "only for the fleet's workers (register, then heartbeat within the lease)")
            while True:
                seen = self.generation
                granted = self.index.reserve(request.worker_id, request.fragments, self.reservation_ttl,
                                             request.starting, self.leases.count if self.leases else 1)
                left = deadline - time.monotonic()
                if granted or not request.fragments or left <= 0 or self.stopping.is_set() or not context.is_active():
                    break
                if not waiting:
                    waiting = self._waiting_reserves.acquire(blocking=False)
                    if not waiting:
                        raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                      f"{self.max_waiting_reserves} Reserve calls already wait for room at this "
                                      "front (--max-waiting-reserves): ask again later, or run more fronts")
                self.wait_change(seen, left)
        except IndexUnavailable as err:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"{err}; retry") from None
        finally:
            if waiting:
                self._waiting_reserves.release()
        RESERVED.inc(granted)
        return replay_buffer_pb2.ReserveResponse(granted=granted, limited=True, ttl_seconds=self.reservation_ttl)

    def forget_lapsed_holders(self) -> int:
        """Give back the room of workers whose lease is gone (leases.py); returns how much came back."""
        if self.leases is None or not self.reservations or self.index.limiter is None:
            return 0
        gone = self.leases.gone(self.index.holders())
        back = self.index.forget_holders(gone) if gone else 0
        if back:
            log.info("gave back %d fragments' room held by %s: no lease at the rollout-manager", back, ", ".join(gone))
            self.notify()
        return back

    # ----------------------------------------------------------------- control and statistics

    def SetModelVersion(self, request: replay_buffer_pb2.SetModelVersionRequest,
                        context: grpc.ServicerContext) -> replay_buffer_pb2.SetModelVersionResponse:
        try:
            move = self.index.set_model_version(request.model_version)
        except ValueError as err:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(err)) from None
        except IndexUnavailable as err:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"{err}; retry") from None
        if move.dropped_chunks:
            DROPS.labels("stale").inc(move.dropped_chunks)
        self.deletes.later(move.delete_blobs)
        self.notify()
        return replay_buffer_pb2.SetModelVersionResponse(dropped_chunks=move.dropped_chunks)

    def GetStoreInfo(self, request: replay_buffer_pb2.GetStoreInfoRequest,
                     context: grpc.ServicerContext) -> replay_buffer_pb2.StoreInfo:
        """The blob store's URL (no credentials) and the ref grace, for blob_refs readers."""
        return replay_buffer_pb2.StoreInfo(blob_store_url=self.store_url, ref_grace_seconds=self.ref_grace)

    def GetStats(self, request: replay_buffer_pb2.GetStatsRequest,
                 context: grpc.ServicerContext) -> replay_buffer_pb2.BufferStats:
        try:
            s = self.refresh_metrics()
        except IndexUnavailable as err:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"{err}; retry") from None
        return replay_buffer_pb2.BufferStats(
            fragments=s.fragments, chunks=s.chunks, bytes=s.bytes, inserted_fragments=s.inserted_fragments,
            sampled_chunks=s.sampled_chunks, dropped_chunks=s.dropped, rejected_fragments=rejects_by_reason(),
            model_version=s.model_version, mean_reuse=s.mean_reuse, mean_staleness=s.mean_staleness,
            max_staleness=s.max_staleness, capacity_chunks=self.max_chunks, reserved_fragments=s.reserved_fragments,
            expired_reservations=s.expired_reservations)

    def refresh_metrics(self) -> IndexStats:
        s = self.index.stats()
        FRAGMENTS.set(s.fragments)
        BYTES.set(s.bytes)
        STALENESS.labels("mean").set(s.mean_staleness)
        STALENESS.labels("max").set(s.max_staleness)
        RESERVED_NOW.set(s.reserved_fragments)
        MEAN_REUSE.set(s.mean_reuse)
        return s


def add_to_server(service: ReplayBufferService, server: grpc.Server) -> None:
    """Register the ReplayBuffer service like the generated `add_ReplayBufferServicer_to_server`, but with
    the fragment payloads passed through as bytes: an inserted fragment is stored exactly as received
    and a sampled chunk is sent exactly as stored, never parsed into protobuf objects and serialized
    again. Same wire protocol; use it wherever the service is served."""
    pb = replay_buffer_pb2
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Insert": grpc.stream_stream_rpc_method_handler(
            service.insert_raw, request_deserializer=None, response_serializer=pb.InsertResponse.SerializeToString),
        "Sample": grpc.unary_stream_rpc_method_handler(
            service.sample_raw, request_deserializer=pb.SampleRequest.FromString, response_serializer=None),
        "SetModelVersion": grpc.unary_unary_rpc_method_handler(
            service.SetModelVersion, request_deserializer=pb.SetModelVersionRequest.FromString,
            response_serializer=pb.SetModelVersionResponse.SerializeToString),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            service.GetStats, request_deserializer=pb.GetStatsRequest.FromString,
            response_serializer=pb.BufferStats.SerializeToString),
        "Reserve": grpc.unary_unary_rpc_method_handler(
            service.Reserve, request_deserializer=pb.ReserveRequest.FromString,
            response_serializer=pb.ReserveResponse.SerializeToString),
        "GetStoreInfo": grpc.unary_unary_rpc_method_handler(
            service.GetStoreInfo, request_deserializer=pb.GetStoreInfoRequest.FromString,
            response_serializer=pb.StoreInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
