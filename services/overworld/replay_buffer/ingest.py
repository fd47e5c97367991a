"""Ingest (Insert, bidi-streaming): each fragment is validated, its blob written, then its index entry
added, and only then acknowledged.

Blob writes of one stream run in parallel (up to `ingest_window` in flight), index adds and acks stay
in arrival order, and the stream stops reading while the window is full or the rate limiter blocks:
that is the backpressure a worker feels. A fragment is stored exactly as received: its tensors are
checked through numpy views on the received bytes.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, Protocol

import grpc
from google.protobuf.message import DecodeError

from overworld.core.grpc_util import Refused
from overworld.core.wire import tensors
from overworld.core.wire.fragment import Fragment, FragmentError, validate
from overworld.core.wire.tensors import TensorDecodeError
from overworld.replay_buffer import wire
from overworld.replay_buffer.front import Front
from overworld.replay_buffer.index import (
    BLOCKED,
    DUPLICATE,
    OK,
    SWEPT,
    AddResult,
    FragmentMeta,
    IndexUnavailable,
    ReplayIndex,
)
from overworld.replay_buffer.metrics import DROPS, DUPLICATES, INGEST_LATENCY, INSERTS, REJECTS
from overworld.v1 import common_pb2, replay_buffer_pb2

if TYPE_CHECKING:
    from overworld.core.specs import Spaces

log = logging.getLogger("overworld.replay_buffer")

IDLE_CHECK_SECONDS = 1.0  # what wakes a waiting call is notified; this only bounds a wait for stop()
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def _safe(part: str) -> str:
    return _UNSAFE.sub("_", part)[:64] or "_"


def fragments_prefix(run_id: str) -> str:
    """Where the blobs of a run's fragments live in the blob store."""
    return f"{_safe(run_id)}/fragments/"


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


@dataclass
class _Received:
    header: common_pb2.FragmentHeader
    blob: bytes | memoryview  # the serialized Fragment, as the worker sent it
    tensors: bytes | memoryview


@dataclass
class _Pending:
    header: common_pb2.FragmentHeader
    meta: FragmentMeta
    blob: bytes | memoryview
    put: Future
    started: float


class _Rejected(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def split_insert_request(raw: bytes) -> _Received:
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


class IngestFront(Front, Protocol):
    """What an Insert call needs of its ReplayBufferService beyond what every call does (front.py)."""

    fragment_length: int
    ingest_window: int
    max_fragment_bytes: int
    prefix: str
    report: InsertReport
    run_id: str
    spaces: Callable[[], Spaces | None]


class InsertStream:
    """One Insert call. A thread of its own reads the requests into an inbox (and stops reading while
    `ingest_window` wait there); the handler checks each, starts its blob write (up to `ingest_window`
    in flight), and indexes and acknowledges the writes in arrival order as they finish."""

    def __init__(self, front: IngestFront, requests: Iterator[bytes], context: grpc.ServicerContext) -> None:
        self.front = front
        self.requests = requests
        self.context = context
        self._wake = threading.Condition()  # new requests, taken requests and finished writes notify
        self._inbox: deque[tuple[float, bytes]] = deque()  # (received at, serialized InsertRequest)
        self._inflight: deque[_Pending] = deque()  # blob writes started, in arrival order
        self._reading_ended = False
        self._done = False  # the handler has finished: the reader stops
        self._over = False  # the stream has ended

    def responses(self) -> Iterator[replay_buffer_pb2.InsertResponse]:
        reader = threading.Thread(target=self._read, name="rb-insert-reader", daemon=True)
        reader.start()
        try:
            while not self._over:
                yield from self._acknowledge_finished()
                request = self._next_request()
                if request is not None:
                    yield from self._admit(*request)
        finally:
            with self._wake:
                self._done = True
                self._wake.notify_all()

    def _read(self) -> None:
        try:
            for request in self.requests:
                with self._wake:
                    self._inbox.append((time.monotonic(), request))
                    self._wake.notify_all()
                    # Stop reading while the window is full: gRPC flow control pushes back on the worker.
                    while len(self._inbox) >= self.front.ingest_window and not self._done:
                        self._wake.wait(IDLE_CHECK_SECONDS)  # the handler notifies when it takes one
                    if self._done:
                        return
        except Exception:  # the client cancelled or the connection broke: the handler sees the reading end
            pass
        finally:
            with self._wake:
                self._reading_ended = True
                self._wake.notify_all()

    def _next_request(self) -> tuple[float, bytes] | None:
        """The next request, if the window has room for its write. None: nothing to take yet (after waiting
        for a request or a write, unless the oldest write has finished), or the stream is over (`_over`)."""
        with self._wake:
            if self._inbox and len(self._inflight) < self.front.ingest_window:
                request = self._inbox.popleft()
                self._wake.notify_all()
                return request
            if self._reading_ended and not self._inbox and not self._inflight:
                self._over = True
            elif not (self._inflight and self._inflight[0].put.done()):
                self._wake.wait(IDLE_CHECK_SECONDS)  # the reader and finished writes notify; this bounds stop()
                if self.front.stopping.is_set():
                    raise Refused(grpc.StatusCode.UNAVAILABLE, "replay buffer is shutting down; retry elsewhere")
                if not self.context.is_active():
                    self._over = True
            return None

    def _acknowledge_finished(self) -> Iterator[replay_buffer_pb2.InsertResponse]:
        while self._inflight and self._inflight[0].put.done():
            yield self._commit(self._inflight.popleft())

    def _acknowledge_all(self) -> Iterator[replay_buffer_pb2.InsertResponse]:
        while self._inflight:
            yield self._commit(self._inflight.popleft())

    def _admit(self, started: float, raw: bytes) -> Iterator[replay_buffer_pb2.InsertResponse]:
        """Check one request and start its blob write; a bad fragment ends the stream."""
        received: _Received | None = None
        try:
            received = split_insert_request(raw)
            fragment = self._check(received)
        except _Rejected as err:
            # Earlier fragments are acknowledged first, so the worker knows which one was refused.
            yield from self._acknowledge_all()
            self._refuse(received, err)
        if self.front.stopping.is_set():
            yield from self._acknowledge_all()  # what was written is indexed and acknowledged; the rest is resent
            raise Refused(grpc.StatusCode.UNAVAILABLE, "replay buffer is shutting down; retry elsewhere")
        pending = self._start_write(received, fragment, started)
        pending.put.add_done_callback(self._wake_up)
        self._inflight.append(pending)

    def _wake_up(self, _: Future) -> None:
        with self._wake:
            self._wake.notify_all()

    def _refuse(self, received: _Received | None, err: _Rejected) -> NoReturn:
        h = received.header if received else common_pb2.FragmentHeader()
        if not err.reason:
            raise Refused(grpc.StatusCode.UNAVAILABLE, str(err))
        REJECTS.labels(err.reason).inc()
        log.warning("rejected fragment from %s/%s#%s (%s): %s", h.worker_id, h.env_slot, h.sequence,
                    err.reason, err)
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"fragment rejected ({err.reason}): {err}")

    def _check(self, r: _Received) -> Fragment:
        """The fragment (numpy views on the received bytes where possible), or _Rejected(reason, message)."""
        front, h = self.front, r.header
        if len(r.tensors) > front.max_fragment_bytes:
            raise _Rejected("oversized", f"{len(r.tensors)} bytes exceeds max_fragment_bytes {front.max_fragment_bytes}")
        if h.length != front.fragment_length:
            raise _Rejected("length", f"length {h.length}, this run's fragment_length is {front.fragment_length}")
        spaces = front.spaces()
        if spaces is None:
            raise _Rejected("", "the run's spaces are not known yet (no rollout worker has registered); retry")
        try:
            try:
                if h.compression != common_pb2.COMPRESSION_NONE:
                    raise wire.WireError("compressed")
                data = wire.decode_views(memoryview(r.tensors))
            except wire.WireError:  # compressed, or something only the full decoder can judge
                data = tensors.decode(bytes(r.tensors), h.compression, front.max_fragment_bytes)
            fragment = Fragment(h.run_id, h.worker_id, h.env_slot, h.sequence, data)
            validate(fragment, spaces, front.fragment_length, front.run_id)
        except TensorDecodeError as err:
            raise _Rejected("decode", str(err)) from None
        except FragmentError as err:
            reason = "nan" if "NaN" in str(err) else ("run" if "belongs to run" in str(err) else "spec")
            raise _Rejected(reason, str(err)) from None
        if int(fragment.data["model_version"][0]) != h.first_model_version:
            raise _Rejected("header", "header.first_model_version does not match model_version[0]")
        return fragment

    def _blob_key(self, h: common_pb2.FragmentHeader) -> str:
        return f"{self.front.prefix}{_safe(h.worker_id)}/{h.env_slot}/{h.sequence:012d}-{uuid.uuid4().hex[:12]}"

    def _start_write(self, r: _Received, fragment: Fragment, started: float) -> _Pending:
        h = r.header
        key = self._blob_key(h)
        meta = FragmentMeta(fragment.slot_key, h.sequence, h.first_model_version, len(r.blob), key, h.worker_id)
        return _Pending(h, meta, r.blob, self.front.io.submit(self.front.blobs.put, key, r.blob), started)

    def _commit(self, p: _Pending) -> replay_buffer_pb2.InsertResponse:
        """Index a fragment whose blob write was started; returns its ack (or aborts the stream)."""
        front, context = self.front, self.context
        try:
            p.put.result()
        except Exception as err:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"blob store write failed: {err}; retry") from None
        meta = p.meta
        while True:
            seen = front.generation
            try:
                result: AddResult = front.index.add(meta)
            except IndexUnavailable as err:
                raise Refused(grpc.StatusCode.UNAVAILABLE, f"{err}; retry") from None
            if result.status == BLOCKED:
                # The rate limiter waits for samples (a sample notifies; so do the call's end and stop()).
                if not context.is_active():
                    raise Refused(grpc.StatusCode.CANCELLED, "client went away")
                if front.stopping.is_set():
                    raise Refused(grpc.StatusCode.UNAVAILABLE, "replay buffer is shutting down; retry elsewhere")
                front.wait_change(seen, IDLE_CHECK_SECONDS)
                continue
            if result.status == SWEPT:  # stalled past the sweeper's grace period: write it again
                meta = FragmentMeta(meta.slot_key, meta.sequence, meta.first_model_version, meta.nbytes,
                                    self._blob_key(p.header), meta.holder)
                front.blobs.put(meta.blob_key, p.blob)
                continue
            break
        front.deletes.later(result.delete_blobs)
        for reason, n in result.dropped.items():
            DROPS.labels(reason).inc(n)
        if result.status == OK:
            INSERTS.inc()
            front.report.inserted()
        else:
            DUPLICATES.inc()
        INGEST_LATENCY.observe(time.monotonic() - p.started)
        front.notify()
        h = p.header
        return replay_buffer_pb2.InsertResponse(worker_id=h.worker_id, env_slot=h.env_slot, sequence=h.sequence,
                                                stored=result.stored or result.status == DUPLICATE)
