"""Sample (server-streaming): chunks are claimed (atomically, in the index) at most `prefetch` ahead of
what was sent, and their blobs fetched in parallel while earlier chunks are being streamed.

With `SampleRequest.blob_refs` the front sends each claimed chunk's blob keys instead, and the reader
fetches the blobs from the store itself (`GetStoreInfo` names it): the 3 MB payloads then skip the
front's gRPC hop, while the claim (reuse counting, rate limiter, deadline) stays the front's. A
sampled chunk is sent exactly as stored, never parsed into protobuf objects and serialized again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Protocol

import grpc

from overworld.core.grpc_util import Refused
from overworld.replay_buffer import wire
from overworld.replay_buffer.front import Front
from overworld.replay_buffer.index import Claim, IndexUnavailable
from overworld.replay_buffer.metrics import DROPS, REF_SAMPLES, SAMPLE_LAG, SAMPLE_WAIT, SAMPLES
from overworld.v1 import replay_buffer_pb2

log = logging.getLogger("overworld.replay_buffer")

MAX_SAMPLE_TIMEOUT = 86400.0  # a day: longer is a mistake (and past the platform's time_t when huge)


def check_sample_request(request: replay_buffer_pb2.SampleRequest, context: grpc.ServicerContext, max_chunks: int,
                         default_timeout: float) -> None:
    """Abort the call with INVALID_ARGUMENT unless num_chunks and timeout_seconds are in range."""
    if request.num_chunks == 0 or request.num_chunks > max_chunks:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
              f"num_chunks must be in [1, max_chunks={max_chunks}], got {request.num_chunks}")
    if not 0 <= request.timeout_seconds <= MAX_SAMPLE_TIMEOUT:  # also NaN
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_seconds must be in [0, {MAX_SAMPLE_TIMEOUT:g}] "
              f"seconds (0: the server's default of {default_timeout:g}), got {request.timeout_seconds}")


class SampleFront(Front, Protocol):
    """What a Sample call needs of its ReplayBufferService beyond what every call does (front.py)."""

    default_sample_timeout: float
    prefetch: int


class SampleStream:
    """One Sample call: claim ahead, send the oldest claim's chunk when its blobs are read, and wait for data
    (until the deadline) when there is nothing to send."""

    def __init__(self, front: SampleFront, request: replay_buffer_pb2.SampleRequest,
                 context: grpc.ServicerContext) -> None:
        self.front = front
        self.request = request
        self.context = context
        self.refs = request.blob_refs
        self.timeout = request.timeout_seconds or front.default_sample_timeout
        self.started = time.monotonic()
        self.deadline = self.started + self.timeout
        self.sent = 0
        # (claim, its blobs being fetched; None with blob_refs: nothing to fetch)
        self.pending: deque[tuple[Claim, Future | None]] = deque()
        self.learner: int | None = None  # the learner's model version, for the policy lag of what is sent

    def chunks(self) -> Iterator[bytes]:
        """The serialized SampledChunks of the call, as they are claimed and read."""
        try:
            self.learner = self.front.index.model_version()
        except IndexUnavailable:
            self.learner = None  # the lag of this call goes unmeasured; the claims below answer UNAVAILABLE
        while self.sent < self.request.num_chunks:
            seen = self.front.generation
            self._claim_ahead()
            if self.pending:
                yield from self._send_oldest()
                continue
            now = time.monotonic()
            if now >= self.deadline or not self.context.is_active() or self.front.stopping.is_set():
                self._end_short()
                return
            self.front.wait_change(seen, self.deadline - now)

    def release_unsent(self) -> None:
        """Claimed but never sent (the client went away, an error): a final claim's chunk has left the
        index, so its blobs are deleted like those of a sent one."""
        for claim, _ in self.pending:
            if claim.final:
                DROPS.labels("reused").inc()
                self.front.deletes.later(claim.chunk.blob_keys)

    def _claim_ahead(self) -> None:
        room = self.request.num_chunks - self.sent - len(self.pending)
        # By reference there is nothing to fetch ahead: claim everything asked for in one step.
        want = room if self.refs else min(room, self.front.prefetch - len(self.pending))
        if want <= 0 or self.front.stopping.is_set():
            return
        try:
            claims = self.front.index.claim(want, by_ref=self.refs)
        except IndexUnavailable as err:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"{err}; retry") from None
        if claims:
            if self.refs:
                self.front.deletes.note_ref_claim()  # before any of their blobs is queued for deletion
            self.front.notify()
        for claim in claims:
            self.pending.append((claim, None if self.refs else self.front.io.submit(self._fetch, claim)))

    def _fetch(self, claim: Claim) -> list[bytes]:
        return [self.front.blobs.get(k) for k in claim.chunk.blob_keys]

    def _send_oldest(self) -> Iterator[bytes]:
        """The oldest claim's chunk, once its blobs are read (none if they vanished meanwhile)."""
        claim, _ = self.pending[0]
        payload = self._payload(claim)
        if payload is None:
            return
        keys = claim.chunk.blob_keys
        if self.sent == 0:
            SAMPLE_WAIT.observe(time.monotonic() - self.started)
        self.pending.popleft()
        if claim.final:
            DROPS.labels("reused").inc()
            self.front.deletes.later(keys)
        yield payload
        SAMPLES.inc(len(keys))
        if self.learner is not None:
            SAMPLE_LAG.observe(max(0, self.learner - claim.chunk.first_model_version))
        if self.refs:
            REF_SAMPLES.inc(len(keys))
        self.sent += 1

    def _payload(self, claim: Claim) -> bytes | None:
        """The oldest claim's serialized SampledChunk: its blob keys (by reference) or its fragments, waiting
        for their read. None: a blob vanished between claim and read, and the claim is dropped."""
        _, reading = self.pending[0]
        keys = claim.chunk.blob_keys
        if reading is None:
            return replay_buffer_pb2.SampledChunk(chunk_id=claim.chunk.chunk_id, times_sampled=claim.chunk.times_sampled,
                                                  blob_keys=keys).SerializeToString()
        try:
            blobs = reading.result()
        except (FileNotFoundError, KeyError):
            self.pending.popleft()
            log.warning("chunk %d vanished between claim and read; skipped", claim.chunk.chunk_id)
            if claim.final:
                self.front.deletes.later(keys)
            return None
        except Exception as err:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"blob store read failed: {err}; retry") from None
        return wire.sampled_chunk(claim.chunk.chunk_id, blobs, claim.chunk.times_sampled)

    def _end_short(self) -> None:
        """At the deadline, with the client gone or the front stopping: the call ends with what it sent
        (allow_partial, or nobody listens), or with an error that says why."""
        if self.request.allow_partial or not self.context.is_active():
            return
        if self.front.stopping.is_set():
            raise Refused(grpc.StatusCode.UNAVAILABLE, "replay buffer is shutting down; retry elsewhere")
        try:
            why = self.front.index.describe_wait()
        except IndexUnavailable as err:
            why = str(err)
        raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
              f"only {self.sent} of {self.request.num_chunks} chunks after {self.timeout:.1f}s ({why})")
