"""Client side of the replay buffer for trainer readers: the Sample stream, and sampling by reference.

`sample_stream` runs one Sample call through a restart of the front: a stream that breaks keeps the
chunks it delivered (they were claimed, and count as sampled) and the reader asks for the rest; a call
that got nothing is retried with backoff.

With `SampleRequest.blob_refs` the front claims chunks as usual (reuse counting, rate limiter,
deadline) but hands out their blob keys; the reader fetches the blobs from the blob store itself
(`GetStoreInfo` names it), so that 3 MB payloads skip the front's gRPC hop. `blob_store_for(stub)`
decides whether a reader samples by reference (and opens the store once per process), and
`fetch_chunks` turns the referenced chunks into ordinary SampledChunk messages with their fragments.
A chunk whose blob cannot be read is skipped (warned and counted), never an error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from prometheus_client import Counter

from overworld.core.blobs import BlobStore, open_blob_store
from overworld.core.grpc_util import Retry
from overworld.v1 import replay_buffer_pb2, replay_buffer_pb2_grpc

log = logging.getLogger("overworld.replay_buffer.client")

SKIPPED_CHUNKS = Counter("overworld_replay_buffer_reader_skipped_chunks_total",
                         "Chunks a reader claimed by reference and skipped because a blob could not be read "
                         "(reason: missing = deleted after the buffer's grace period, error = the store failed)",
                         ["reason"])
REF_FETCH_THREADS = 32  # blob gets in flight per reader process (one S3 connection each)
REF_RETRY_SECONDS = 60.0  # after the store failed, sample in-band this long before trying again
_ref_stores: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_ref_lock = threading.Lock()
_ref_opened: dict[str, BlobStore] = {}  # by URL: one store (one connection pool) per process
_ref_pool: list[ThreadPoolExecutor] = []
# Read buffers, reused: a fresh 3 MB object per blob costs more in page faults than the read itself.
REF_BUFFERS_KEPT = 16
_ref_buffers: list[bytearray] = []
_buffers_lock = threading.Lock()


class _NoRefs(Exception):
    pass


def sample_stream(stub: replay_buffer_pb2_grpc.ReplayBufferStub, request: replay_buffer_pb2.SampleRequest,
                  timeout: float, deadline: float) -> list[replay_buffer_pb2.SampledChunk]:
    """The chunks of one Sample call (each attempt `timeout` at most, all of them `deadline`). A stream
    that breaks after delivering chunks returns them (fewer than asked: ask again for the rest)."""
    got: list[replay_buffer_pb2.SampledChunk] = []

    def attempt(left: float) -> None:
        try:
            for chunk in stub.Sample(request, timeout=min(left, timeout)):
                got.append(chunk)
        except grpc.RpcError as err:
            if not got:
                raise
            log.warning("%s: Sample stream broke after %d of %d chunks (%s); asking again for the rest",
                        request.reader_id, len(got), request.num_chunks, err.code().name)

    Retry(deadline).run(attempt, "Sample")
    return got


def blob_store_for(stub: replay_buffer_pb2_grpc.ReplayBufferStub, blob_refs: bool | None) -> BlobStore | None:
    """The blob store to fetch sampled blobs from (sampling by reference), or None to sample in-band.
    blob_refs None: by reference when the buffer's store is S3 (a local directory is in-band); True: also
    a local directory, if it exists here. Asked of the front once per stub (GetStoreInfo), again
    REF_RETRY_SECONDS after a failure; S3 credentials come from this process's OVERWORLD_S3_*. Stubs of
    one buffer share one store, so one connection pool."""
    if blob_refs is False:
        return None
    with _ref_lock:
        entry = _ref_stores.get(stub)
        if entry is None or (entry["store"] is None and time.monotonic() >= entry["retry_at"]):
            entry = {"url": "", "store": None, "retry_at": time.monotonic() + REF_RETRY_SECONDS}
            try:
                if not hasattr(stub, "GetStoreInfo"):  # stubs generated before blob_refs
                    raise _NoRefs
                entry["url"] = stub.GetStoreInfo(replay_buffer_pb2.GetStoreInfoRequest(), timeout=10).blob_store_url
                url = entry["url"]
                if url.startswith("s3://") or os.path.isdir(url):
                    entry["store"] = _ref_opened.get(url) or _ref_opened.setdefault(url, open_blob_store(url))
            except _NoRefs:
                entry["retry_at"] = float("inf")
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # a front without blob_refs: in-band for good
                    entry["retry_at"] = float("inf")
                else:
                    log.warning("replay buffer GetStoreInfo failed (%s); sampling in-band for now", err.code())
            except Exception as err:  # e.g. no OVERWORLD_S3_ENDPOINT here
                log.warning("cannot open the replay buffer's blob store %s (%s); sampling in-band", entry["url"], err)
            _ref_stores[stub] = entry
        if entry["store"] is None or not (blob_refs or entry["url"].startswith("s3://")):
            return None
        return entry["store"]


def fetch_chunks(stub: replay_buffer_pb2_grpc.ReplayBufferStub, store: BlobStore, reader_id: str,
                refs: list[replay_buffer_pb2.SampledChunk]) -> list[replay_buffer_pb2.SampledChunk]:
    """Chunks sampled by reference -> chunks with their fragments, every blob fetched in parallel. A chunk
    whose blob cannot be read is skipped (warned and counted); a store failure, or a call whose every
    blob is missing (a reader slower than the grace, or a store that is not the front's: same bucket name
    on another endpoint?), also switches this stub to in-band sampling for REF_RETRY_SECONDS."""
    with _ref_lock:
        if not _ref_pool:
            _ref_pool.append(ThreadPoolExecutor(REF_FETCH_THREADS, thread_name_prefix="chunk-fetch"))
        pool = _ref_pool[0]
    jobs = [(ref, [pool.submit(_read_blob, store, key) for key in ref.blob_keys]) for ref in refs]
    chunks = []
    missing = 0
    for ref, gets in jobs:
        if not ref.blob_keys:  # sent in-band (a front that ignores blob_refs)
            chunks.append(ref)
            continue
        blobs: list[tuple[bytearray | None, bytes | memoryview]] = []
        error: Exception | None = None
        for get in gets:
            try:
                blobs.append(get.result())
            except Exception as err:
                error = error or err
        try:
            if error is None:
                chunk = replay_buffer_pb2.SampledChunk(chunk_id=ref.chunk_id, times_sampled=ref.times_sampled)
                for _, blob in blobs:  # each blob is one serialized Fragment, as the worker sent it
                    chunk.fragments.add().MergeFromString(blob)
                chunks.append(chunk)
        finally:
            for buf, blob in blobs:
                _release(buf, blob)
        if isinstance(error, (KeyError, FileNotFoundError)):
            missing += 1
            SKIPPED_CHUNKS.labels("missing").inc()
            log.warning("%s: chunk %d skipped: blob %s is gone (deleted after the buffer's grace period?)",
                        reader_id, ref.chunk_id, error)
        elif error is not None:
            SKIPPED_CHUNKS.labels("error").inc()
            log.warning("%s: chunk %d skipped: blob store read failed (%s); sampling in-band for %.0fs",
                        reader_id, ref.chunk_id, error, REF_RETRY_SECONDS)
            fall_back(stub)
    if missing and missing == len(jobs):
        log.warning("%s: none of the %d sampled chunks' blobs were in %s; sampling in-band for %.0fs",
                    reader_id, missing, getattr(store, "url", "the blob store"), REF_RETRY_SECONDS)
        fall_back(stub)
    return chunks


def fall_back(stub: replay_buffer_pb2_grpc.ReplayBufferStub) -> None:
    """Sample in-band through this stub for REF_RETRY_SECONDS, then ask the front again."""
    with _ref_lock:
        _ref_stores[stub] = {"url": "", "store": None, "retry_at": time.monotonic() + REF_RETRY_SECONDS}


def _read_blob(store: BlobStore, key: str) -> tuple[bytearray | None, bytes | memoryview]:
    """One blob: read into a pooled buffer where the store can (BlobStore.get_into), else as bytes."""
    if not hasattr(store, "get_into"):
        return None, store.get(key)
    with _buffers_lock:
        buf = _ref_buffers.pop() if _ref_buffers else bytearray()
    try:
        return buf, store.get_into(key, buf)
    except BaseException:
        _release(buf, None)
        raise


def _release(buf: bytearray | None, blob: bytes | memoryview | None) -> None:
    if isinstance(blob, memoryview):
        blob.release()
    if buf is not None:
        with _buffers_lock:
            if len(_ref_buffers) < REF_BUFFERS_KEPT:
                _ref_buffers.append(buf)
