"""The reader's side of sampling by reference: which blob store to fetch from, and the fetch.

With `SampleRequest.blob_refs` the front claims chunks as usual (reuse counting, rate limiter,
deadline) but hands out their blob keys; the reader fetches the blobs from the blob store itself
(`GetStoreInfo` names it), so that 3 MB payloads skip the front's gRPC hop. `BlobRefReader.store_for`
decides whether a reader samples by reference (and opens the store once per client), and
`BlobRefReader.fetch` turns the referenced chunks into ordinary SampledChunk messages with their
fragments. A chunk whose blob cannot be read is skipped (warned and counted), never an error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from prometheus_client import Counter

from overworld.core.blobs.store import BlobStore
from overworld.core.blobs.urls import open_blob_store
from overworld.v1 import replay_buffer_pb2

log = logging.getLogger("overworld.replay_buffer.refs")

SKIPPED_CHUNKS = Counter("overworld_replay_buffer_reader_skipped_chunks_total",
                         "Chunks a reader claimed by reference and skipped because a blob could not be read "
                         "(reason: missing = deleted after the buffer's grace period, error = the store failed)",
                         ["reason"])
REF_FETCH_THREADS = 32  # blob gets in flight per client (one S3 connection each)
REF_RETRY_SECONDS = 60.0  # after the store failed, sample in-band this long before trying again
# Read buffers, reused: a fresh 3 MB object per blob costs more in page faults than the read itself.
REF_BUFFERS_KEPT = 16


@dataclass
class _StoreChoice:
    """What the front said about its store: `store` None samples in-band until `retry_at` (monotonic)."""

    url: str
    store: BlobStore | None
    retry_at: float


class BlobRefReader:
    """Sampling by reference for one client (one buffer): the store, the fetch threads and the read buffers."""

    def __init__(self, store_info: Callable[[], replay_buffer_pb2.StoreInfo]) -> None:
        """`store_info`: the front's GetStoreInfo, one attempt (the client's `store_info`)."""
        self._store_info = store_info
        self._lock = threading.Lock()
        self._choice: _StoreChoice | None = None
        self._opened: dict[str, BlobStore] = {}  # by URL: one store (one connection pool) per client
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: list[bytearray] = []
        self._buffers_lock = threading.Lock()

    def store_for(self, blob_refs: bool | None) -> BlobStore | None:
        """The blob store to fetch sampled blobs from (sampling by reference), or None to sample in-band.
        blob_refs None: by reference when the buffer's store is S3 (a local directory is in-band); True: also
        a local directory, if it exists here. Asked of the front once per client (GetStoreInfo), again
        REF_RETRY_SECONDS after a failure; S3 credentials come from this process's OVERWORLD_S3_*."""
        if blob_refs is False:
            return None
        with self._lock:
            choice = self._choice
            if choice is None or (choice.store is None and time.monotonic() >= choice.retry_at):
                choice = self._choice = self._ask_front()
            if choice.store is None or not (blob_refs or choice.url.startswith("s3://")):
                return None
            return choice.store

    def _ask_front(self) -> _StoreChoice:
        choice = _StoreChoice("", None, time.monotonic() + REF_RETRY_SECONDS)
        try:
            choice.url = self._store_info().blob_store_url
            url = choice.url
            if url.startswith("s3://") or os.path.isdir(url):
                choice.store = self._opened.get(url) or self._opened.setdefault(url, open_blob_store(url))
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # a front without blob_refs: in-band for good
                choice.retry_at = float("inf")
            else:
                log.warning("replay buffer GetStoreInfo failed (%s); sampling in-band for now", err.code())
        except Exception as err:  # e.g. no OVERWORLD_S3_ENDPOINT here
            log.warning("cannot open the replay buffer's blob store %s (%s); sampling in-band", choice.url, err)
        return choice

    def fall_back(self) -> None:
        """Sample in-band for REF_RETRY_SECONDS, then ask the front again."""
        with self._lock:
            self._choice = _StoreChoice("", None, time.monotonic() + REF_RETRY_SECONDS)

    def fetch(self, store: BlobStore, reader_id: str,
              refs: list[replay_buffer_pb2.SampledChunk]) -> list[replay_buffer_pb2.SampledChunk]:
        """Chunks sampled by reference -> chunks with their fragments, every blob fetched in parallel. A chunk
        whose blob cannot be read is skipped (warned and counted); a store failure, or a call whose every
        blob is missing (a reader slower than the grace, or a store that is not the front's: same bucket name
        on another endpoint?), also switches this client to in-band sampling for REF_RETRY_SECONDS."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(REF_FETCH_THREADS, thread_name_prefix="chunk-fetch")
            pool = self._pool
        jobs = [(ref, [pool.submit(self._read_blob, store, key) for key in ref.blob_keys]) for ref in refs]
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
                    self._release(buf, blob)
            if isinstance(error, (KeyError, FileNotFoundError)):
                missing += 1
                SKIPPED_CHUNKS.labels("missing").inc()
                log.warning("%s: chunk %d skipped: blob %s is gone (deleted after the buffer's grace period?)",
                            reader_id, ref.chunk_id, error)
            elif error is not None:
                SKIPPED_CHUNKS.labels("error").inc()
                log.warning("%s: chunk %d skipped: blob store read failed (%s); sampling in-band for %.0fs",
                            reader_id, ref.chunk_id, error, REF_RETRY_SECONDS)
                self.fall_back()
        if missing and missing == len(jobs):
            log.warning("%s: none of the %d sampled chunks' blobs were in %s; sampling in-band for %.0fs",
                        reader_id, missing, getattr(store, "url", "the blob store"), REF_RETRY_SECONDS)
            self.fall_back()
        return chunks

    def _read_blob(self, store: BlobStore, key: str) -> tuple[bytearray | None, bytes | memoryview]:
        """One blob: read into a pooled buffer where the store can (BlobStore.get_into), else as bytes."""
        if not hasattr(store, "get_into"):
            return None, store.get(key)
        with self._buffers_lock:
            buf = self._buffers.pop() if self._buffers else bytearray()
        try:
            return buf, store.get_into(key, buf)
        except BaseException:
            self._release(buf, None)
            raise

    def _release(self, buf: bytearray | None, blob: bytes | memoryview | None) -> None:
        if isinstance(blob, memoryview):
            blob.release()
        if buf is not None:
            with self._buffers_lock:
                if len(self._buffers) < REF_BUFFERS_KEPT:
                    self._buffers.append(buf)

    def close(self) -> None:
        """Stop the fetch threads (a fetch in progress finishes)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
