"""The replay-buffer gRPC front: admission checks, blob + index writes, sampling, version moves.

Fronts are stateless: everything they know lives in the index and the blob store, so several
fronts can serve one run. A blob is always written before its index entry.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import grpc
from prometheus_client import Counter, Gauge, Histogram

from overworld.core.blobs import BlobStore
from overworld.core.fragment import Fragment, FragmentError, validate
from overworld.core.grpc_util import abort
from overworld.core.specs import Spaces
from overworld.core.tensors import TensorDecodeError
from overworld.replay_buffer.index import FragmentMeta, ReplayIndex
from overworld.v1 import common_pb2, replay_buffer_pb2, replay_buffer_pb2_grpc

log = logging.getLogger("overworld.replay_buffer")

FRAGMENTS = Gauge("overworld_replay_buffer_fragments", "Fragments held")
BYTES = Gauge("overworld_replay_buffer_bytes", "Bytes held")
CAPACITY = Gauge("overworld_replay_buffer_capacity_fragments", "Capacity in fragments")
INSERTS = Counter("overworld_replay_buffer_inserts_total", "Fragments accepted")
SAMPLES = Counter("overworld_replay_buffer_samples_total", "Fragments sampled")
DROPS = Counter("overworld_replay_buffer_drops_total", "Chunks removed, by reason", ["reason"])
REJECTS = Counter("overworld_replay_buffer_rejects_total", "Invalid fragments refused", ["reason"])
SAMPLE_WAIT = Histogram("overworld_replay_buffer_sample_wait_seconds", "Time a Sample call waited for data")
INGEST_LATENCY = Histogram("overworld_replay_buffer_ingest_latency_seconds", "Validate + store time per fragment",
                           buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
STALENESS = Gauge("overworld_replay_buffer_staleness", "Model versions behind, over held chunks", ["stat"])
MEAN_REUSE = Gauge("overworld_replay_buffer_mean_reuse", "Mean times sampled of removed chunks")

POLL_SECONDS = 0.05  # other fronts' changes are seen by polling the shared index


class ReplayBufferService(replay_buffer_pb2_grpc.ReplayBufferServicer):
    def __init__(self, index: ReplayIndex, blobs: BlobStore, run_id: str, fragment_length: int,
                 fragments_per_chunk: int, max_chunks: int, spaces: Callable[[], Spaces | None],
                 max_fragment_bytes: int = 64 * 1024 * 1024, default_sample_timeout: float = 60.0) -> None:
        self.index = index
        self.blobs = blobs
        self.run_id = run_id
        self.fragment_length = fragment_length
        self.max_chunks = max_chunks
        self.spaces = spaces
        self.max_fragment_bytes = max_fragment_bytes
        self.default_sample_timeout = default_sample_timeout
        self._changed = threading.Condition()
        self._reported_drops: dict[str, int] = {}
        self._stopping = threading.Event()
        CAPACITY.set(max_chunks * fragments_per_chunk)

    def stop(self) -> None:
        self._stopping.set()
        self._notify()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _wait_for(self, ready: Callable[[], bool], deadline: float, context: grpc.ServicerContext) -> bool:
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not context.is_active() or self._stopping.is_set():
                return False
            with self._changed:
                self._changed.wait(min(remaining, POLL_SECONDS))
        return True

    def _reject(self, context: grpc.ServicerContext, reason: str, message: str, worker: str) -> None:
        REJECTS.labels(reason).inc()
        log.warning("rejected fragment from %s (%s): %s", worker, reason, message)
        abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"fragment rejected ({reason}): {message}")

    def _admit(self, msg: common_pb2.Fragment, context: grpc.ServicerContext) -> Fragment:
        h = msg.header
        worker = f"{h.worker_id}/{h.env_slot}#{h.sequence}"
        if len(msg.tensors) > self.max_fragment_bytes:
            self._reject(context, "oversized", f"{len(msg.tensors)} bytes exceeds max_fragment_bytes "
                         f"{self.max_fragment_bytes}", worker)
        if h.length != self.fragment_length:
            self._reject(context, "length", f"length {h.length}, this run's fragment_length is "
                         f"{self.fragment_length}", worker)
        spaces = self.spaces()
        if spaces is None:
            abort(context, grpc.StatusCode.UNAVAILABLE,
                  "the run's spaces are not known yet (no rollout worker has registered); retry")
        try:
            fragment = Fragment.from_proto(msg, max_bytes=self.max_fragment_bytes)
            validate(fragment, spaces, self.fragment_length, self.run_id)
        except TensorDecodeError as err:
            self._reject(context, "decode", str(err), worker)
        except FragmentError as err:
            reason = "nan" if "NaN" in str(err) else ("run" if "belongs to run" in str(err) else "spec")
            self._reject(context, reason, str(err), worker)
        if int(fragment.data["model_version"][0]) != h.first_model_version:
            self._reject(context, "header", "header.first_model_version does not match model_version[0]", worker)
        return fragment

    def Insert(self, request_iterator: Iterator[replay_buffer_pb2.InsertRequest],
               context: grpc.ServicerContext) -> Iterator[replay_buffer_pb2.InsertResponse]:
        for request in request_iterator:
            started = time.monotonic()
            msg = request.fragment
            fragment = self._admit(msg, context)
            if not self._wait_for(self.index.can_insert, float("inf"), context):
                if self._stopping.is_set():
                    abort(context, grpc.StatusCode.UNAVAILABLE, "replay buffer is shutting down; retry elsewhere")
                return
            h = msg.header
            key = f"{self.run_id}/fragments/{h.worker_id}/{h.env_slot}/{h.sequence:012d}-{uuid.uuid4().hex[:8]}"
            blob = msg.SerializeToString()
            self.blobs.put(key, blob)
            result = self.index.add(FragmentMeta(fragment.slot_key, h.sequence, h.first_model_version, len(blob), key))
            if result.delete_blobs:
                self.blobs.delete(result.delete_blobs)
            INSERTS.inc()
            INGEST_LATENCY.observe(time.monotonic() - started)
            self._notify()
            yield replay_buffer_pb2.InsertResponse(
                worker_id=h.worker_id, env_slot=h.env_slot, sequence=h.sequence, stored=result.stored)

    def Sample(self, request: replay_buffer_pb2.SampleRequest,
               context: grpc.ServicerContext) -> Iterator[replay_buffer_pb2.SampledChunk]:
        if request.num_chunks == 0 or request.num_chunks > self.max_chunks:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"num_chunks must be in [1, max_chunks={self.max_chunks}], got {request.num_chunks}")
        timeout = request.timeout_seconds or self.default_sample_timeout
        started = time.monotonic()
        deadline = started + timeout
        sent = 0
        while sent < request.num_chunks:
            claims = self.index.claim(request.num_chunks - sent)
            if claims:
                self._notify()
            for claim in claims:
                try:
                    fragments = [common_pb2.Fragment.FromString(self.blobs.get(k)) for k in claim.chunk.blob_keys]
                except (FileNotFoundError, KeyError):
                    log.warning("chunk %d vanished between claim and read (evicted); skipped", claim.chunk.chunk_id)
                    continue
                if sent == 0:
                    SAMPLE_WAIT.observe(time.monotonic() - started)
                yield replay_buffer_pb2.SampledChunk(
                    chunk_id=claim.chunk.chunk_id, fragments=fragments, times_sampled=claim.chunk.times_sampled)
                SAMPLES.inc(len(fragments))
                sent += 1
                if claim.final:
                    self.blobs.delete(claim.chunk.blob_keys)
            if sent >= request.num_chunks:
                break
            if claims:
                continue
            now = time.monotonic()
            if now >= deadline or not context.is_active() or self._stopping.is_set():
                if request.allow_partial or not context.is_active():
                    return
                abort(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"only {sent} of {request.num_chunks} chunks after {timeout:.1f}s "
                      f"({self.index.describe_wait()})")
            with self._changed:
                self._changed.wait(min(deadline - now, POLL_SECONDS))

    def SetModelVersion(self, request: replay_buffer_pb2.SetModelVersionRequest,
                        context: grpc.ServicerContext) -> replay_buffer_pb2.SetModelVersionResponse:
        try:
            delete = self.index.set_model_version(request.model_version)
        except ValueError as err:
            abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(err))
        self.blobs.delete(delete)
        self._notify()
        return replay_buffer_pb2.SetModelVersionResponse(dropped_chunks=len(delete))

    def GetStats(self, request: replay_buffer_pb2.GetStatsRequest,
                 context: grpc.ServicerContext) -> replay_buffer_pb2.BufferStats:
        s = self.refresh_metrics()
        return replay_buffer_pb2.BufferStats(
            fragments=s.fragments, chunks=s.chunks, bytes=s.bytes, inserted_fragments=s.inserted_fragments,
            sampled_chunks=s.sampled_chunks, dropped_chunks=s.dropped, rejected_fragments=_rejects(),
            model_version=s.model_version, mean_reuse=s.mean_reuse, mean_staleness=s.mean_staleness,
            max_staleness=s.max_staleness, capacity_chunks=self.max_chunks)

    def refresh_metrics(self):  # type: ignore[no-untyped-def]
        s = self.index.stats()
        FRAGMENTS.set(s.fragments)
        BYTES.set(s.bytes)
        STALENESS.labels("mean").set(s.mean_staleness)
        STALENESS.labels("max").set(s.max_staleness)
        MEAN_REUSE.set(s.mean_reuse)
        for reason, count in s.dropped.items():
            new = count - self._reported_drops.get(reason, 0)
            if new > 0:
                DROPS.labels(reason).inc(new)
            self._reported_drops[reason] = count
        return s


def _rejects() -> dict[str, int]:
    out = {}
    for metric in REJECTS.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["reason"]] = int(sample.value)
    return out
