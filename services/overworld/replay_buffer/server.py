"""The replay-buffer gRPC front: admission checks, blob + index writes, sampling, version moves.

Fronts are stateless: everything they know lives in the index and the blob store, so several
fronts can serve one run, and a front killed at any moment loses nothing it acknowledged.

Ingest (Insert, bidi-streaming): each fragment is validated, its blob written, then its index entry
added, and only then acknowledged. Blob writes of one stream run in parallel (up to
`ingest_window` in flight), index adds and acks stay in arrival order, and the stream stops reading
while the window is full or the rate limiter blocks: that is the backpressure a worker feels.

Sample (server-streaming): chunks are claimed (atomically, in the index) at most `prefetch` ahead
of what was sent, and their blobs fetched in parallel while earlier chunks are being streamed. With
`SampleRequest.blob_refs` the front sends each claimed chunk's blob keys instead, and the reader
fetches the blobs from the store itself (`GetStoreInfo` names it): the 3 MB payloads then skip the
front's gRPC hop, while the claim — reuse counting, rate limiter, deadline — stays the front's.

Blobs of chunks that leave the index are deleted after `delete_delay` seconds, so that a reader that
claimed a chunk just before it left can still read it; while claims by reference are being made (any
front's: the index remembers the last one, and every front asks it more often than delete_delay),
after `ref_grace` seconds instead, so that a reader handed the keys can still fetch them. Blobs
nobody references (a front died between blob write and index add, or before its deferred deletes
ran) are removed by the orphan sweeper, which also spares a key for `ref_grace` after it first saw it
unreferenced.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import Counter, Gauge, Histogram

from overworld.core import tensors
from overworld.core.blobs import BlobStore
from overworld.core.fragment import Fragment, FragmentError, validate
from overworld.core.grpc_util import abort
from overworld.core.specs import Spaces
from overworld.core.tensors import TensorDecodeError
from overworld.replay_buffer import wire
from overworld.replay_buffer.index import (
    BLOCKED,
    DUPLICATE,
    OK,
    SWEPT,
    AddResult,
    Claim,
    FragmentMeta,
    IndexStats,
    IndexUnavailable,
    MemoryIndex,
    ReplayIndex,
)
from overworld.replay_buffer.sweeper import OrphanSweeper
from overworld.v1 import common_pb2, replay_buffer_pb2, replay_buffer_pb2_grpc

log = logging.getLogger("overworld.replay_buffer")

MAX_SAMPLE_TIMEOUT = 86400.0  # a day: longer is a mistake (and past the platform's time_t when huge)

FRAGMENTS = Gauge("overworld_replay_buffer_fragments", "Fragments held")
BYTES = Gauge("overworld_replay_buffer_bytes", "Bytes held")
CAPACITY = Gauge("overworld_replay_buffer_capacity_fragments", "Capacity in fragments")
INSERTS = Counter("overworld_replay_buffer_inserts_total", "Fragments accepted")
SAMPLES = Counter("overworld_replay_buffer_samples_total", "Fragments sampled")
DROPS = Counter("overworld_replay_buffer_drops_total", "Chunks removed, by reason", ["reason"])
REJECTS = Counter("overworld_replay_buffer_rejects_total", "Invalid fragments refused", ["reason"])
SAMPLE_WAIT = Histogram("overworld_replay_buffer_sample_wait_seconds", "Time a Sample call waited for data",
                        buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 120.0))
INGEST_LATENCY = Histogram("overworld_replay_buffer_ingest_latency_seconds",
                           "Receipt to acknowledgement per fragment (validate + blob write + index add)",
                           buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 2.5))
STALENESS = Gauge("overworld_replay_buffer_staleness", "Model versions behind, over held chunks", ["stat"])
SAMPLE_LAG = Histogram("overworld_replay_buffer_sample_policy_lag",
                       "Policy lag of sampled chunks: model versions between the learner's and the one that acted "
                       "(at the chunk's first step)", buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64))
MEAN_REUSE = Gauge("overworld_replay_buffer_mean_reuse", "Mean times sampled of removed chunks")
DUPLICATES = Counter("overworld_replay_buffer_duplicates_total",
                     "Fragments at or below their slot's last sequence number (resends), acknowledged, not re-added")
ORPHANS = Counter("overworld_replay_buffer_orphans_swept_total", "Unreferenced blobs deleted by the sweeper")
REF_SAMPLES = Counter("overworld_replay_buffer_ref_samples_total",
                      "Fragments sampled as blob keys (blob_refs: the reader fetched them from the store)")

SERVICE_NAME = "overworld.v1.ReplayBuffer"
POLL_SECONDS = 0.05  # other fronts' changes to a shared (Redis) index are seen by polling it
IDLE_CHECK_SECONDS = 1.0  # what wakes a waiting call is notified; this only bounds a wait for stop()
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _safe(part: str) -> str:
    return _UNSAFE.sub("_", part)[:64] or "_"


def fragments_prefix(run_id: str) -> str:
    """Where the blobs of a run's fragments live in the blob store."""
    return f"{_safe(run_id)}/fragments/"


@dataclass
class _Pending:
    header: common_pb2.FragmentHeader
    meta: FragmentMeta
    blob: bytes | memoryview
    put: Future
    started: float


@dataclass
class _Received:
    header: common_pb2.FragmentHeader
    blob: bytes | memoryview  # the serialized Fragment, as the worker sent it
    tensors: bytes | memoryview


class _Rejected(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class InsertReport:
    """MineStudio's `fragments_per_report`: every that many stored fragments, one log line with the
    ingest rate, the size in chunks and the model version (MineStudio's replay_buffer/* metrics)."""

    def __init__(self, every: int, index: ReplayIndex) -> None:
        self.every, self.index = every, index
        self.count = 0
        self.since = time.monotonic()
        self._lock = threading.Lock()

    def inserted(self) -> str | None:
        if self.every <= 0:
            return None
        with self._lock:
            self.count += 1
            if self.count % self.every:
                return None
            now, since = time.monotonic(), self.since
            self.since = now
        stats = self.index.stats()
        line = (f"replay_buffer/fragments_per_second {self.every / max(now - since, 1e-9):.2f}, "
                f"replay_buffer_size (chunk) {stats.chunks}, model_version {stats.model_version}")
        log.info(line)
        return line


class ReplayBufferService(replay_buffer_pb2_grpc.ReplayBufferServicer):
    def __init__(self, index: ReplayIndex, blobs: BlobStore, run_id: str, fragment_length: int,
                 fragments_per_chunk: int, max_chunks: int, spaces: Callable[[], Spaces | None],
                 max_fragment_bytes: int = 64 * 1024 * 1024, default_sample_timeout: float = 60.0, *,
                 ingest_window: int = 4, prefetch: int = 4, io_threads: int = 16, delete_delay: float = 2.0,
                 sweep_interval: float = 60.0, orphan_grace: float = 600.0, metrics_interval: float = 2.0,
                 ref_grace: float = 60.0, store_url: str | None = None, fragments_per_report: int = 0) -> None:
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
        # How often the index is asked about the last claim by reference (more often than delete_delay, so
        # that a delete that comes due has normally seen every such claim made before its chunk left; a
        # delete waits for such a poll in any case).
        self._refs_poll = max(POLL_SECONDS, min(0.5, delete_delay / 2)) if self.ref_grace > delete_delay else 0.0
        self._refs_until = 0.0  # (monotonic) a claim by reference may be recent until then
        self._refs_polled = float("-inf")  # (monotonic) when the last successful poll started
        self.store_url = getattr(blobs, "url", "") if store_url is None else store_url
        self.sweep_interval = sweep_interval
        self.metrics_interval = metrics_interval
        self.prefix = fragments_prefix(run_id)
        self.sweeper = OrphanSweeper(index, blobs, self.prefix, orphan_grace, self.ref_grace)
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="rb-io")
        self._changed = threading.Condition()
        self._generation = 0  # counts _notify() calls: a waiter that read it before looking misses none
        self._shared_index = not isinstance(index, MemoryIndex)
        self._stopping = threading.Event()
        self._maintenance_wake = threading.Event()
        self._deletes: deque[tuple[float, list[str]]] = deque()  # (when they left the index, keys)
        self._postponed: deque[tuple[float, list[str]]] = deque()  # the same, waiting out the ref grace
        self._deletes_lock = threading.Lock()
        self._maintenance = threading.Thread(target=self._maintain, name="rb-maintenance", daemon=True)
        CAPACITY.set(max_chunks * fragments_per_chunk)
        self._maintenance.start()

    # ----------------------------------------------------------------- lifecycle and housekeeping

    def stop(self) -> None:
        """Stop serving (in-flight calls end with UNAVAILABLE) and run the blob deletes that are due.
        Blobs still within their grace period are left to the orphan sweeper (any front's): a reader
        handed their keys by this front may still be fetching them."""
        self._stopping.set()
        self._maintenance_wake.set()
        self._notify()
        self._maintenance.join(10.0)
        self._run_deletes()
        with self._deletes_lock:
            left = sum(len(keys) for _, keys in (*self._deletes, *self._postponed))
        if left:
            log.info("%d blobs of chunks that left the buffer are within their grace period; the orphan "
                     "sweeper deletes them later", left)
        self._io.shutdown(wait=False)  # queued writes and reads finish; handlers deliver them in the grace period

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

    def _notify(self, *_: object) -> None:
        with self._changed:
            self._generation += 1
            self._changed.notify_all()

    def _delete_later(self, keys: list[str]) -> None:
        """Delete blobs that the index no longer references (their chunk left it): after delete_delay (a
        reader that claimed the chunk just before it left still reads it), or after ref_grace when claims
        by reference may have been made (such a reader fetches the blobs itself, later)."""
        if keys:
            with self._deletes_lock:
                self._deletes.append((time.monotonic(), keys))
            self._maintenance_wake.set()

    def _note_ref_claim(self) -> None:
        with self._deletes_lock:
            self._refs_until = max(self._refs_until, time.monotonic() + self.ref_grace)

    def _poll_refs(self) -> None:
        started = time.monotonic()
        age = self.index.ref_claim_age()
        with self._deletes_lock:
            if age is not None and age < self.ref_grace:
                # (measured after the answer: the claim is placed no earlier than it was)
                self._refs_until = max(self._refs_until, time.monotonic() - age + self.ref_grace)
            self._refs_polled = started

    def _run_deletes(self) -> None:
        now = time.monotonic()
        due: list[str] = []
        with self._deletes_lock:
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

    def _next_delete_due(self) -> float:
        """When the oldest queued delete comes due; one overdue but held back (it waits for a poll for
        claims by reference) is looked at again POLL_SECONDS later."""
        with self._deletes_lock:
            due = [self._deletes[0][0] + self.delete_delay] if self._deletes else []
            due += [self._postponed[0][0] + self.ref_grace] if self._postponed else []
        return max(min(due, default=float("inf")), time.monotonic() + POLL_SECONDS)

    def _maintain(self) -> None:
        """Sleeps until the next thing is due (a blob delete, a poll for claims by reference, metrics, the
        sweep); a new delete wakes it (`_delete_later`), so does stop()."""
        never = float("inf")
        next_metrics = next_sweep = next_poll = time.monotonic()
        if self.sweep_interval > 0:
            next_sweep += self.sweep_interval
        while True:
            wake_at = min(next_poll if self._refs_poll else never, next_metrics if self.metrics_interval > 0 else never,
                          next_sweep if self.sweep_interval > 0 else never, self._next_delete_due())
            self._maintenance_wake.wait(None if wake_at == never else max(0.0, wake_at - time.monotonic()))
            self._maintenance_wake.clear()
            if self._stopping.is_set():
                return
            now = time.monotonic()
            if self._refs_poll and now >= next_poll:
                next_poll = now + self._refs_poll
                try:
                    self._poll_refs()
                except IndexUnavailable as err:  # deletes wait (at most the ref grace) for a poll
                    log.warning("checking for claims by reference failed: %s", err)
                except Exception:
                    log.exception("checking for claims by reference failed")
            self._run_deletes()
            try:
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

    def _wait_change(self, seen: int, timeout: float) -> None:
        """Until this front changes something after `seen` (its `_generation` read before the caller
        looked), a call ends (their handlers notify), or `timeout`. An in-process index changes only here:
        nothing to poll. A shared index also changes by other fronts: polled every POLL_SECONDS."""
        if self._shared_index:
            timeout = min(timeout, POLL_SECONDS)
        with self._changed:
            self._changed.wait_for(lambda: self._generation != seen, max(0.0, timeout))

    # ----------------------------------------------------------------- ingest

    @staticmethod
    def _split(raw: bytes) -> _Received:
        """A serialized InsertRequest -> header, fragment bytes and tensor bytes, without copying the
        tensors (protobuf parsing as the fallback for unusual encodings)."""
        try:
            fragment = wire.length_delimited_fields(memoryview(raw)).get(1, memoryview(b""))
            fields = wire.length_delimited_fields(fragment)
            header = common_pb2.FragmentHeader.FromString(fields.get(1, memoryview(b"")))
            return _Received(header, fragment, fields.get(2, memoryview(b"")))
        except (wire.WireError, DecodeError):
            try:
                msg = replay_buffer_pb2.InsertRequest.FromString(raw).fragment
            except DecodeError as err:
                raise _Rejected("decode", f"not an InsertRequest: {err}") from None
            return _Received(msg.header, msg.SerializeToString(), msg.tensors)

    def _check(self, r: _Received) -> Fragment:
        """The fragment (numpy views on the received bytes where possible), or _Rejected(reason, message)."""
        h = r.header
        if len(r.tensors) > self.max_fragment_bytes:
            raise _Rejected("oversized", f"{len(r.tensors)} bytes exceeds max_fragment_bytes {self.max_fragment_bytes}")
        if h.length != self.fragment_length:
            raise _Rejected("length", f"length {h.length}, this run's fragment_length is {self.fragment_length}")
        spaces = self.spaces()
        if spaces is None:
            raise _Rejected("", "the run's spaces are not known yet (no rollout worker has registered); retry")
        try:
            try:
                if h.compression != common_pb2.COMPRESSION_NONE:
                    raise wire.WireError("compressed")
                data = wire.decode_views(memoryview(r.tensors))
            except wire.WireError:  # compressed, or something only the full decoder can judge
                data = tensors.decode(bytes(r.tensors), h.compression, self.max_fragment_bytes)
            fragment = Fragment(h.run_id, h.worker_id, h.env_slot, h.sequence, data)
            validate(fragment, spaces, self.fragment_length, self.run_id)
        except TensorDecodeError as err:
            raise _Rejected("decode", str(err)) from None
        except FragmentError as err:
            reason = "nan" if "NaN" in str(err) else ("run" if "belongs to run" in str(err) else "spec")
            raise _Rejected(reason, str(err)) from None
        if int(fragment.data["model_version"][0]) != h.first_model_version:
            raise _Rejected("header", "header.first_model_version does not match model_version[0]")
        return fragment

    def _blob_key(self, h: common_pb2.FragmentHeader) -> str:
        return f"{self.prefix}{_safe(h.worker_id)}/{h.env_slot}/{h.sequence:012d}-{uuid.uuid4().hex[:12]}"

    def _start(self, r: _Received, fragment: Fragment, started: float) -> _Pending:
        h = r.header
        key = self._blob_key(h)
        meta = FragmentMeta(fragment.slot_key, h.sequence, h.first_model_version, len(r.blob), key)
        return _Pending(h, meta, r.blob, self._io.submit(self.blobs.put, key, r.blob), started)

    def _commit(self, p: _Pending, context: grpc.ServicerContext) -> replay_buffer_pb2.InsertResponse:
        """Index a fragment whose blob write was started; returns its ack (or aborts the stream)."""
        try:
            p.put.result()
        except Exception as err:
            abort(context, grpc.StatusCode.UNAVAILABLE, f"blob store write failed: {err}; retry")
        meta = p.meta
        while True:
            seen = self._generation
            try:
                result: AddResult = self.index.add(meta)
            except IndexUnavailable as err:
                abort(context, grpc.StatusCode.UNAVAILABLE, f"{err}; retry")
            if result.status == BLOCKED:
                # The rate limiter waits for samples (a sample notifies; so do the call's end and stop()).
                if not context.is_active():
                    abort(context, grpc.StatusCode.CANCELLED, "client went away")
                if self._stopping.is_set():
                    abort(context, grpc.StatusCode.UNAVAILABLE, "replay buffer is shutting down; retry elsewhere")
                self._wait_change(seen, IDLE_CHECK_SECONDS)
                continue
            if result.status == SWEPT:  # stalled past the sweeper's grace period: write it again
                meta = FragmentMeta(meta.slot_key, meta.sequence, meta.first_model_version, meta.nbytes,
                                    self._blob_key(p.header))
                self.blobs.put(meta.blob_key, p.blob)
                continue
            break
        self._delete_later(result.delete_blobs)
        for reason, n in result.dropped.items():
            DROPS.labels(reason).inc(n)
        if result.status == OK:
            INSERTS.inc()
            self.report.inserted()
        else:
            DUPLICATES.inc()
        INGEST_LATENCY.observe(time.monotonic() - p.started)
        self._notify()
        h = p.header
        return replay_buffer_pb2.InsertResponse(worker_id=h.worker_id, env_slot=h.env_slot, sequence=h.sequence,
                                                stored=result.stored or result.status == DUPLICATE)

    def Insert(self, request_iterator: Iterator[replay_buffer_pb2.InsertRequest],
               context: grpc.ServicerContext) -> Iterator[replay_buffer_pb2.InsertResponse]:
        """Insert as registered by the generated code (parsed messages); `add_to_server` skips the parse."""
        return self.insert_raw((r.SerializeToString() for r in request_iterator), context)

    def insert_raw(self, request_iterator: Iterator[bytes],
                   context: grpc.ServicerContext) -> Iterator[replay_buffer_pb2.InsertResponse]:
        wake = threading.Condition()
        context.add_callback(self._notify)  # an insert blocked by the rate limiter wakes when its call ends
        inbox: deque[tuple[float, bytes]] = deque()
        state = {"ended": False, "error": None, "done": False}

        def read() -> None:
            try:
                for request in request_iterator:
                    with wake:
                        inbox.append((time.monotonic(), request))
                        wake.notify_all()
                        # Stop reading while the window is full: gRPC flow control pushes back on the worker.
                        while len(inbox) >= self.ingest_window and not state["done"]:
                            wake.wait(IDLE_CHECK_SECONDS)  # the handler notifies when it takes one
                        if state["done"]:
                            return
            except Exception as err:  # the client cancelled or the connection broke
                state["error"] = err
            finally:
                with wake:
                    state["ended"] = True
                    wake.notify_all()

        def wake_up(_: Future) -> None:
            with wake:
                wake.notify_all()

        reader = threading.Thread(target=read, name="rb-insert-reader", daemon=True)
        reader.start()
        inflight: deque[_Pending] = deque()
        try:
            while True:
                while inflight and inflight[0].put.done():
                    yield self._commit(inflight.popleft(), context)
                with wake:
                    item = inbox.popleft() if inbox and len(inflight) < self.ingest_window else None
                    if item is not None:
                        wake.notify_all()
                    elif state["ended"] and not inbox and not inflight:
                        return
                    elif not (inflight and inflight[0].put.done()):
                        wake.wait(IDLE_CHECK_SECONDS)  # the reader and finished writes notify; this bounds stop()
                        if self._stopping.is_set():
                            abort(context, grpc.StatusCode.UNAVAILABLE,
                                  "replay buffer is shutting down; retry elsewhere")
                        if not context.is_active():
                            return
                        continue
                if item is None:
                    continue
                started, raw = item
                received: _Received | None = None
                try:
                    received = self._split(raw)
                    fragment = self._check(received)
                except _Rejected as err:
                    # Earlier fragments are acknowledged first, so the worker knows which one was refused.
                    while inflight:
                        yield self._commit(inflight.popleft(), context)
                    h = received.header if received else common_pb2.FragmentHeader()
                    if not err.reason:
                        abort(context, grpc.StatusCode.UNAVAILABLE, str(err))
                    REJECTS.labels(err.reason).inc()
                    log.warning("rejected fragment from %s/%s#%s (%s): %s", h.worker_id, h.env_slot, h.sequence,
                                err.reason, err)
                    abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"fragment rejected ({err.reason}): {err}")
                if self._stopping.is_set():
                    while inflight:  # what was written is indexed and acknowledged; the rest is resent
                        yield self._commit(inflight.popleft(), context)
                    abort(context, grpc.StatusCode.UNAVAILABLE, "replay buffer is shutting down; retry elsewhere")
                pending = self._start(received, fragment, started)
                pending.put.add_done_callback(wake_up)
                inflight.append(pending)
        finally:
            with wake:
                state["done"] = True
                wake.notify_all()

    # ----------------------------------------------------------------- sample

    def _fetch(self, claim: Claim) -> list[bytes]:
        return [self.blobs.get(k) for k in claim.chunk.blob_keys]

    def Sample(self, request: replay_buffer_pb2.SampleRequest,
               context: grpc.ServicerContext) -> Iterator[replay_buffer_pb2.SampledChunk]:
        """Sample as registered by the generated code (messages); `add_to_server` sends the bytes as they are."""
        for raw in self.sample_raw(request, context):
            yield replay_buffer_pb2.SampledChunk.FromString(raw)

    def sample_raw(self, request: replay_buffer_pb2.SampleRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        if request.num_chunks == 0 or request.num_chunks > self.max_chunks:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"num_chunks must be in [1, max_chunks={self.max_chunks}], got {request.num_chunks}")
        if not 0 <= request.timeout_seconds <= MAX_SAMPLE_TIMEOUT:  # also NaN
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"timeout_seconds must be in [0, {MAX_SAMPLE_TIMEOUT:g}] "
                  f"seconds (0: the server's default of {self.default_sample_timeout:g}), got {request.timeout_seconds}")
        timeout = request.timeout_seconds or self.default_sample_timeout
        context.add_callback(self._notify)  # a waiting sample wakes when its call ends
        started = time.monotonic()
        deadline = started + timeout
        # (claim, its blobs being fetched; None with blob_refs: nothing to fetch)
        pending: deque[tuple[Claim, Future | None]] = deque()
        try:
            yield from self._sample(request, context, request.blob_refs, started, deadline, timeout, pending)
        finally:
            # Claimed but never sent (the client went away, an error): a final claim's chunk has left the
            # index, so its blobs are deleted like those of a sent one.
            for claim, _ in pending:
                if claim.final:
                    DROPS.labels("reused").inc()
                    self._delete_later(claim.chunk.blob_keys)

    def _sample(self, request: replay_buffer_pb2.SampleRequest, context: grpc.ServicerContext, refs: bool,
                started: float, deadline: float, timeout: float,
                pending: deque[tuple[Claim, Future | None]]) -> Iterator[bytes]:
        sent = 0
        try:
            learner = self.index.model_version()
        except IndexUnavailable:
            learner = None  # the lag of this call goes unmeasured; the claims below answer UNAVAILABLE
        while sent < request.num_chunks:
            seen = self._generation
            room = request.num_chunks - sent - len(pending)
            # By reference there is nothing to fetch ahead: claim everything asked for in one step.
            want = room if refs else min(room, self.prefetch - len(pending))
            if want > 0 and not self._stopping.is_set():
                try:
                    claims = self.index.claim(want, by_ref=refs)
                except IndexUnavailable as err:
                    abort(context, grpc.StatusCode.UNAVAILABLE, f"{err}; retry")
                if claims:
                    if refs:
                        self._note_ref_claim()  # before any of their blobs is queued for deletion
                    self._notify()
                for claim in claims:
                    pending.append((claim, None if refs else self._io.submit(self._fetch, claim)))
            if pending:
                claim, future = pending[0]
                keys = claim.chunk.blob_keys
                if future is None:
                    payload = replay_buffer_pb2.SampledChunk(
                        chunk_id=claim.chunk.chunk_id, times_sampled=claim.chunk.times_sampled,
                        blob_keys=keys).SerializeToString()
                else:
                    try:
                        blobs = future.result()
                    except (FileNotFoundError, KeyError):
                        pending.popleft()
                        log.warning("chunk %d vanished between claim and read; skipped", claim.chunk.chunk_id)
                        if claim.final:
                            self._delete_later(keys)
                        continue
                    except Exception as err:
                        abort(context, grpc.StatusCode.UNAVAILABLE, f"blob store read failed: {err}; retry")
                    payload = wire.sampled_chunk(claim.chunk.chunk_id, blobs, claim.chunk.times_sampled)
                if sent == 0:
                    SAMPLE_WAIT.observe(time.monotonic() - started)
                pending.popleft()
                if claim.final:
                    DROPS.labels("reused").inc()
                    self._delete_later(keys)
                yield payload
                SAMPLES.inc(len(keys))
                if learner is not None:
                    SAMPLE_LAG.observe(max(0, learner - claim.chunk.first_model_version))
                if refs:
                    REF_SAMPLES.inc(len(keys))
                sent += 1
                continue
            now = time.monotonic()
            if now >= deadline or not context.is_active() or self._stopping.is_set():
                if request.allow_partial or not context.is_active():
                    return
                if self._stopping.is_set():
                    abort(context, grpc.StatusCode.UNAVAILABLE, "replay buffer is shutting down; retry elsewhere")
                try:
                    why = self.index.describe_wait()
                except IndexUnavailable as err:
                    why = str(err)
                abort(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"only {sent} of {request.num_chunks} chunks after {timeout:.1f}s ({why})")
            self._wait_change(seen, deadline - now)

    # ----------------------------------------------------------------- control and statistics

    def SetModelVersion(self, request: replay_buffer_pb2.SetModelVersionRequest,
                        context: grpc.ServicerContext) -> replay_buffer_pb2.SetModelVersionResponse:
        try:
            move = self.index.set_model_version(request.model_version)
        except ValueError as err:
            abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except IndexUnavailable as err:
            abort(context, grpc.StatusCode.UNAVAILABLE, f"{err}; retry")
        if move.dropped_chunks:
            DROPS.labels("stale").inc(move.dropped_chunks)
        self._delete_later(move.delete_blobs)
        self._notify()
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
            abort(context, grpc.StatusCode.UNAVAILABLE, f"{err}; retry")
        return replay_buffer_pb2.BufferStats(
            fragments=s.fragments, chunks=s.chunks, bytes=s.bytes, inserted_fragments=s.inserted_fragments,
            sampled_chunks=s.sampled_chunks, dropped_chunks=s.dropped, rejected_fragments=_rejects(),
            model_version=s.model_version, mean_reuse=s.mean_reuse, mean_staleness=s.mean_staleness,
            max_staleness=s.max_staleness, capacity_chunks=self.max_chunks)

    def refresh_metrics(self) -> IndexStats:
        s = self.index.stats()
        FRAGMENTS.set(s.fragments)
        BYTES.set(s.bytes)
        STALENESS.labels("mean").set(s.mean_staleness)
        STALENESS.labels("max").set(s.max_staleness)
        MEAN_REUSE.set(s.mean_reuse)
        return s


def _rejects() -> dict[str, int]:
    out = {}
    for metric in REJECTS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["reason"]] = int(sample.value)
    return out


def add_to_server(service: ReplayBufferService, server: grpc.Server) -> None:
    """Register the ReplayBuffer service like the generated `add_ReplayBufferServicer_to_server`, but with
    the fragment payloads passed through as bytes: an inserted fragment is stored exactly as received
    and a sampled chunk is sent exactly as stored, never parsed into protobuf objects and serialized
    again. Same wire protocol; use it wherever the service is served."""
    pb = replay_buffer_pb2
    handlers = {
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
        "GetStoreInfo": grpc.unary_unary_rpc_method_handler(
            service.GetStoreInfo, request_deserializer=pb.GetStoreInfoRequest.FromString,
            response_serializer=pb.StoreInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
