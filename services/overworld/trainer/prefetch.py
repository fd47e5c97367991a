"""Readers that sample chunks from the replay buffer, optionally ahead of the learner.

`num_readers` Sample streams split each batch between them; `prefetch_batches` batches are fetched
ahead in the background (0: fetch when asked, which keeps the policy lag of on-policy runs lowest).
Every call has a deadline: nothing here waits forever.

When the buffer's blobs are in S3, chunks are sampled by reference: the front claims them and hands
out their blob keys, and the reader fetches the blobs from the store itself, in parallel threads
(`sample_chunks`), so that 3 MB payloads skip the front's gRPC hop.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from prometheus_client import Counter

from overworld.core.blobs import BlobStore, open_blob_store
from overworld.core.grpc_util import retry
from overworld.v1 import replay_buffer_pb2, replay_buffer_pb2_grpc

log = logging.getLogger("overworld.trainer")

SKIPPED_CHUNKS = Counter("overworld_trainer_skipped_chunks_total",
                         "Sampled chunks skipped because a blob could not be read from the blob store "
                         "(reason: missing = deleted after the buffer's grace period, error = the store failed)",
                         ["reason"])
REF_FETCH_THREADS = 32  # blob gets in flight per trainer process (one S3 connection each)
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


def _ref_store(stub: replay_buffer_pb2_grpc.ReplayBufferStub, blob_refs: bool | None) -> BlobStore | None:
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


def _fetch_refs(stub: replay_buffer_pb2_grpc.ReplayBufferStub, store: BlobStore, reader_id: str,
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
            _fall_back(stub)
    if missing and missing == len(jobs):
        log.warning("%s: none of the %d sampled chunks' blobs were in %s; sampling in-band for %.0fs",
                    reader_id, missing, getattr(store, "url", "the blob store"), REF_RETRY_SECONDS)
        _fall_back(stub)
    return chunks


def _fall_back(stub: replay_buffer_pb2_grpc.ReplayBufferStub) -> None:
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


def sample_chunks(stub: replay_buffer_pb2_grpc.ReplayBufferStub, n: int, timeout: float, reader_id: str,
                  stop: threading.Event | None = None, blob_refs: bool | None = None
                  ) -> list[replay_buffer_pb2.SampledChunk]:
    """n chunks (fewer only when stopped), with their fragments. blob_refs (None: when the buffer's
    blobs are in S3): the front hands out the claimed chunks' blob keys and the blobs are fetched from
    the store here; a chunk whose blob is gone is skipped and another one sampled in its place."""
    chunks: list[replay_buffer_pb2.SampledChunk] = []
    while len(chunks) < n and not (stop and stop.is_set()):
        store = _ref_store(stub, blob_refs)
        request = replay_buffer_pb2.SampleRequest(num_chunks=n - len(chunks), timeout_seconds=timeout,
                                                  reader_id=reader_id, allow_partial=True,
                                                  blob_refs=store is not None)
        got = retry(lambda r=request: list(stub.Sample(r, timeout=timeout + 30)), "Sample", timeout + 60)
        if not got:
            log.info("%s waiting for data: %d of %d chunks", reader_id, len(chunks), n)
        elif store is not None:
            got = _fetch_refs(stub, store, reader_id, got)
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
            batch = self._fetch()
            while not self.stop.is_set():
                try:
                    self.queue.put(batch, timeout=0.5)
                    break
                except queue.Full:
                    continue

    def next(self) -> list[replay_buffer_pb2.SampledChunk]:
        if self.queue is None:
            return self._fetch()
        return self.queue.get()

    def close(self) -> None:
        self.stop.set()
        self.pool.shutdown(wait=False, cancel_futures=True)
