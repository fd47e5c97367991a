"""The model-registry: versioned weights (safetensors + JSON manifest) in the blob store, tags,
retention, and a watch stream that pushes every new version to subscribed rollout workers.

How a version travels (docs/model_registry.md has the whole story):

1. Publish (client-streamed): the manifest first, then the bytes. As soon as the manifest is accepted
   the version is *announced* on every Watch stream, and Fetch of it streams the bytes as they
   arrive (cut-through), so the fan-out to the workers overlaps the upload instead of following it.
2. Once every byte has arrived and its sha256 matches the manifest, the Fetch streams end with OK:
   only then may a watcher swap the version in. A mismatch ends them with DATA_LOSS and stores
   nothing; a publisher that goes away ends them with ABORTED.
3. The weights blob, then the manifest, are written to the blob store; the version is listed (and
   `latest`) once its manifest is written, and Publish returns. On restart the index is rebuilt from
   the manifests.

Each chunk of a version is encoded once as a WeightsChunk message and the same bytes object is sent
to every watcher (`wire.py`); the latest version stays in memory, so a fetch reads no blob.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict, ParseDict
from prometheus_client import Counter, Gauge, Histogram

from overworld.core import weights
from overworld.core.blobs import BlobStore
from overworld.core.grpc_util import abort
from overworld.model_registry import wire
from overworld.v1 import model_registry_pb2 as pb
from overworld.v1 import model_registry_pb2_grpc

log = logging.getLogger("overworld.model_registry")

LATEST = Gauge("overworld_registry_latest_version", "Latest published model version")
PUBLISH_SECONDS = Histogram("overworld_registry_publish_seconds",
                            "Publish: manifest received to version stored and listed",
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
PUSH_LATENCY = Histogram("overworld_registry_push_latency_seconds",
                         "Publish (manifest received) to the last watcher connected at that time acknowledging",
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
LAST_PUSH_LATENCY = Gauge("overworld_registry_last_push_latency_seconds",
                          "Push latency of the most recent completely pushed version")
BYTES_PUSHED = Counter("overworld_registry_bytes_pushed_total", "Weight bytes sent by Fetch")
BYTES_PUBLISHED = Counter("overworld_registry_bytes_published_total", "Weight bytes received by Publish")
FETCHES = Counter("overworld_registry_fetches_total", "Fetch streams started", ["precision"])
PUBLISH_FAILURES = Counter("overworld_registry_publish_failures_total", "Publishes refused or broken", ["reason"])
WATCHERS = Gauge("overworld_registry_watchers", "Open watch streams (distinct watcher ids)")
WORKERS_PER_VERSION = Gauge("overworld_registry_workers_per_version",
                            "Connected watchers by the model version they last acknowledged (or resumed with)",
                            ["version"])

DEFAULT_CHUNK = 4 << 20  # messages group small tensors up to this size
LARGEST_MESSAGE = 64 << 20  # a tensor up to this size travels in one message (viewed there, not copied)
# A fetch with its own chunk size is cut into at most this many messages: chunk_size=1 would otherwise
# turn one request into a message per byte (hours of a registry thread for a large model).
MAX_FETCH_MESSAGES = 4096
ALIGN = 16  # tensor data starts at this alignment inside a message
RESERVED_TAGS = {"latest"}
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
TAGS_KEY = "models/tags.json"
PUSH_HISTORY = 64  # push results kept for GetPushStatus

RECEIVING, VERIFIED, FAILED = "receiving", "verified", "failed"


def weights_key(version: int) -> str:
    return f"models/{version:010d}/weights.safetensors"


def manifest_key(version: int) -> str:
    return f"models/{version:010d}/manifest.json"


class PayloadFailed(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def message_bounds(head: bytes | bytearray | memoryview, size: int, target: int, largest: int) -> list[int] | None:
    """Where the messages of a payload end. For safetensors, at tensor boundaries: small tensors are
    grouped up to `target` bytes, a larger one gets a message of its own (split only beyond
    `largest`), so that a receiver can view every tensor inside the message it received instead of
    copying it out. Otherwise every `target` bytes. None while `head` is too short to tell."""
    fixed = [*range(target, size, target), size] if size else []
    view = memoryview(head)
    if len(view) < 8:
        return None if len(view) < size else fixed
    n = int.from_bytes(view[:8], "little")
    if n > weights.MAX_HEADER_BYTES or 8 + n > size:
        return fixed
    if len(view) < 8 + n:
        return None
    try:
        header, data_start = weights.read_header(view[:8 + n])
        spans = sorted((data_start + int(m["data_offsets"][0]), data_start + int(m["data_offsets"][1]))
                       for k, m in header.items() if k != "__metadata__")
    except (ValueError, KeyError, TypeError, IndexError):
        return fixed
    bounds: list[int] = []
    start = 0  # of the message being filled; the header goes with the first tensors
    for begin, end in spans:
        if begin < start or end > size or end < begin:
            return fixed  # overlapping or out of range: not a layout to rely on
        if end - start <= target:
            continue
        if begin > start:  # close the group before this tensor
            bounds.append(begin)
            start = begin
            if end - start <= target:  # it opens the next group
                continue
        if end - start <= largest:  # the tensor alone
            bounds.append(end)
        else:  # larger than any message may be: pieces (the receiver copies this one)
            bounds.extend(range(start + largest, end, largest))
            bounds.append(end)
        start = end
    if size > start:
        bounds.append(size)
    return bounds


class Payload:
    """The bytes of one version as the encoded WeightsChunk messages every Fetch sends.

    Filled message by message while a Publish streams in (`extend`), or at once from stored bytes
    (`complete`). Readers wait on `cond` for messages that have not arrived yet.
    """

    _seq = 0
    _seq_lock = threading.Lock()

    def __init__(self, info: pb.VersionInfo, chunk_size: int = DEFAULT_CHUNK, largest: int = LARGEST_MESSAGE) -> None:
        with Payload._seq_lock:
            Payload._seq += 1
            self.seq = Payload._seq  # tells a re-published version from the failed attempt before it
        self.info = info
        self.size = info.size_bytes
        self.chunk_size = chunk_size
        self.largest = max(largest, chunk_size)
        self.bounds: list[int] | None = None if self.size else []  # message ends, once the header is in
        self.starts: list[int] = []
        self.messages: list[bytes] = []
        self.header_lens: list[int] = []
        self._pending: list[memoryview] = []  # received, not encoded yet
        self._pending_len = 0
        self.state = RECEIVING
        self.error: PayloadFailed | None = None
        self.cond = threading.Condition()
        self.variants: dict[str, Payload] = {}
        self._variant_lock = threading.Lock()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """The next bytes of the payload, in order (any piece size). Encodes every message they
        complete, each with one copy of the bytes (no assembly buffer), and wakes the readers.
        Only the publishing thread calls this."""
        if len(data):
            self._pending.append(memoryview(data))
            self._pending_len += len(data)
        if self.bounds is None:
            n = int.from_bytes(self._prefix(8), "little") if self._pending_len >= 8 else 0
            head = self._prefix(8 + n if n <= weights.MAX_HEADER_BYTES else 8)
            bounds = message_bounds(head, self.size, self.chunk_size, self.largest)
            if bounds is None and self._pending_len < self.size:
                return  # the header is not complete yet
            with self.cond:
                self.bounds = bounds or [*range(self.chunk_size, self.size, self.chunk_size), self.size]
                self.cond.notify_all()
        messages, header_lens, starts = [], [], []
        index = len(self.messages)
        start = self.bounds[index - 1] if index else 0
        while index < len(self.bounds) and self.bounds[index] - start <= self._pending_len:
            n = self.bounds[index] - start
            pieces: list[bytes | memoryview] = [wire.chunk_header(start, n, ALIGN)]
            need = n
            while need:
                head = self._pending[0]
                if len(head) <= need:
                    pieces.append(self._pending.pop(0))
                    need -= len(head)
                else:
                    pieces.append(head[:need])
                    self._pending[0] = head[need:]
                    need = 0
            self._pending_len -= n
            messages.append(b"".join(pieces))
            header_lens.append(len(pieces[0]))
            starts.append(start)
            start = self.bounds[index]
            index += 1
        if messages:
            with self.cond:  # appended under the lock: a reader cannot miss the wake-up
                self.header_lens.extend(header_lens)
                self.starts.extend(starts)
                self.messages.extend(messages)
                self.cond.notify_all()

    def _prefix(self, n: int) -> bytes:
        """The first n bytes pending (fewer if fewer have arrived)."""
        out, need = [], n
        for view in self._pending:
            if need <= 0:
                break
            out.append(view[:need])
            need -= len(out[-1])
        return b"".join(out)

    def complete(self, data: bytes | bytearray | memoryview) -> Payload:
        self.feed(data)
        self.mark(VERIFIED)
        return self

    def data_views(self) -> list[memoryview]:
        """The bytes of a complete payload as views into its messages (no copy)."""
        return [memoryview(m)[h:] for m, h in zip(self.messages, self.header_lens, strict=True)]

    def mark(self, state: str, error: PayloadFailed | None = None) -> None:
        with self.cond:
            self.state, self.error = state, error
            self.cond.notify_all()

    def _raise_if_failed_or_gone(self, is_active: Callable[[], bool]) -> None:
        if self.state == FAILED:
            assert self.error is not None
            raise self.error
        if not is_active():
            raise PayloadFailed(grpc.StatusCode.CANCELLED, "the fetch was cancelled")

    def wait_chunk(self, index: int, is_active: Callable[[], bool]) -> bytes | None:
        """The encoded message `index`, waiting for it while the Publish is still streaming; None past
        the last one."""
        with self.cond:
            while True:
                if self.bounds is not None and index >= len(self.bounds):
                    return None
                if index < len(self.messages):
                    return self.messages[index]
                self._raise_if_failed_or_gone(is_active)
                self.cond.wait(1.0)

    def index_of(self, offset: int, is_active: Callable[[], bool]) -> int | None:
        """The index of the message that starts at `offset` (None if none does)."""
        if offset == 0:
            return 0
        with self.cond:
            while self.bounds is None:
                self._raise_if_failed_or_gone(is_active)
                self.cond.wait(1.0)
        i = bisect.bisect_left(self.bounds, offset)
        return i + 1 if i < len(self.bounds) and self.bounds[i] == offset else None

    def wait_verified(self, is_active: Callable[[], bool]) -> None:
        with self.cond:
            while self.state == RECEIVING:
                self._raise_if_failed_or_gone(is_active)
                self.cond.wait(1.0)
            self._raise_if_failed_or_gone(lambda: True)

    def raw(self, start: int, end: int) -> bytes:
        """data[start:end] of a complete payload (for fetches at an odd offset or chunk size)."""
        parts = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while i < len(self.messages) and self.starts[i] < end:
            base, head = self.starts[i], self.header_lens[i]
            stop = self.bounds[i] if self.bounds else base
            lo, hi = max(start, base) - base, min(end, stop) - base
            if hi > lo:
                parts.append(memoryview(self.messages[i])[head + lo:head + hi])
            i += 1
        return b"".join(parts)

    def data(self) -> bytes:
        return self.raw(0, self.size)

    def variant(self, precision: str, is_active: Callable[[], bool]) -> Payload:
        """This version with its floating tensors cast to `precision`: converted once, then cached."""
        self.wait_verified(is_active)
        with self._variant_lock:
            found = self.variants.get(precision)
            if found is None:
                try:
                    data = weights.convert(self.data(), precision)
                except ValueError as err:
                    raise PayloadFailed(grpc.StatusCode.FAILED_PRECONDITION,
                                        f"cannot send version {self.info.version} as {precision}: {err}") from None
                info = pb.VersionInfo()
                info.CopyFrom(self.info)
                info.sha256, info.size_bytes = hashlib.sha256(data).hexdigest(), len(data)
                info.dtype = weights.payload_dtype(data)
                found = self.variants[precision] = Payload(info, self.chunk_size, self.largest).complete(data)
            return found


@dataclass
class _Push:
    """Acknowledgements of one published version by the watchers connected when it was announced."""

    started: float  # monotonic, manifest received
    started_unix: float
    waiting: set[str]
    expected: int
    acked: int = 0
    finished: float = 0.0  # monotonic, last acknowledgement
    observed: bool = False
    watchers_left: set[str] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return not self.waiting


class ModelRegistryService(model_registry_pb2_grpc.ModelRegistryServicer):
    def __init__(self, blobs: BlobStore, retain: int = 20, max_model_bytes: int = 8 << 30,
                 chunk_size: int = DEFAULT_CHUNK, largest_message: int = LARGEST_MESSAGE, publish_wait: float = 120.0,
                 keepalive: float = 15.0, cut_through: bool = False) -> None:
        self.blobs = blobs
        self.retain = max(1, retain)
        self.max_model_bytes = max_model_bytes
        self.chunk_size = chunk_size
        self.largest_message = largest_message
        self.publish_wait = publish_wait
        self.keepalive = keepalive
        self.cut_through = cut_through
        self._lock = threading.Condition()
        self._publish_lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._versions: dict[int, pb.VersionInfo] = {}
        self._tags: dict[str, int] = {}
        self._head: Payload | None = None  # the newest version: being published, or the latest stored
        self._inflight: Payload | None = None
        self._cache: dict[int, Payload] = {}  # the latest stored version (and the one being published)
        self._watchers: dict[str, int] = {}  # watcher id -> open Watch streams
        self._running: dict[str, int] = {}  # watcher id -> version it acknowledged (or resumed with)
        self._pushes: dict[int, _Push] = {}
        self._spare: bytearray | None = None
        self._stopping = False
        self._load()

    # -- index ------------------------------------------------------------------------------------
    def _load(self) -> None:
        """Rebuild the index from the manifests: a version exists once its manifest is written.
        Weights without a manifest (a crash between the two writes) are deleted."""
        keys = self.blobs.keys("models/")
        manifests = {k for k in keys if k.endswith("/manifest.json")}
        for key in sorted(manifests):
            info = ParseDict(json.loads(self.blobs.get(key)), pb.VersionInfo(), ignore_unknown_fields=True)
            self._versions[info.version] = info
            for tag in info.tags:
                if tag not in RESERVED_TAGS:
                    self._tags[tag] = info.version
        if TAGS_KEY in keys:  # written on every tag change; wins over the manifests' copies
            stored = json.loads(self.blobs.get(TAGS_KEY))
            self._tags = {t: int(v) for t, v in stored.items() if int(v) in self._versions}
        orphans = [k for k in keys if k.endswith("/weights.safetensors")
                   and k.removesuffix("weights.safetensors") + "manifest.json" not in manifests]
        if orphans:
            log.warning("deleting %d weight blobs without a manifest (an interrupted publish)", len(orphans))
            self.blobs.delete(orphans)
        if self._versions:
            latest = self.latest()
            self._head = Payload(self._versions[latest])
            self._head.mark(VERIFIED)  # bytes loaded on first fetch
            LATEST.set(latest)
            log.info("loaded %d model versions, latest %d, tags %s", len(self._versions), latest, self._tags)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()

    def latest(self) -> int:
        return max(self._versions, default=0)

    def _info(self, version: int) -> pb.VersionInfo:
        info = pb.VersionInfo()
        info.CopyFrom(self._versions[version])
        del info.tags[:]
        info.tags.extend(sorted(t for t, v in self._tags.items() if v == version))
        if version == self.latest():
            info.tags.append("latest")
        return info

    def _manifest_bytes(self, version: int) -> bytes:
        info = self._info(version)
        del info.tags[:]
        info.tags.extend(sorted(t for t, v in self._tags.items() if v == version))
        return json.dumps(MessageToDict(info), indent=1).encode()

    def _save_tags(self) -> None:
        self.blobs.put(TAGS_KEY, json.dumps(self._tags, sort_keys=True).encode())

    def _store(self, key: str, payload: Payload) -> None:
        """Write a payload's bytes to the blob store from its messages: streamed when the store can
        (`put_parts`), else assembled in a buffer reused from one publish to the next (publishes are
        serialised; memory touched for the first time is slower than the copy into it)."""
        put_parts = getattr(self.blobs, "put_parts", None)
        if put_parts is not None:
            put_parts(key, payload.data_views())
            return
        spare, self._spare = self._spare, None
        buf = spare if spare is not None and len(spare) == payload.size else bytearray(payload.size)
        for start, view in zip(payload.starts, payload.data_views(), strict=True):
            buf[start:start + len(view)] = view
        self.blobs.put(key, buf)  # type: ignore[arg-type]  # any bytes-like object
        self._spare = buf

    def _retain(self) -> None:
        keep = set(sorted(self._versions)[-self.retain:]) | set(self._tags.values())
        for version in [v for v in self._versions if v not in keep]:
            del self._versions[version]
            self._cache.pop(version, None)
            # manifest first: a crash in between leaves an orphan blob (deleted on load), never a listed
            # version without its weights
            self.blobs.delete([manifest_key(version)])
            self.blobs.delete([weights_key(version)])

    # -- publish ----------------------------------------------------------------------------------
    def Publish(self, request_iterator: Iterator[pb.PublishRequest], context: grpc.ServicerContext) -> pb.VersionInfo:
        return self.publish_parts((wire.publish_part(r) for r in request_iterator), context)

    def publish_parts(self, parts: Iterator[wire.PublishPart], context: grpc.ServicerContext) -> pb.VersionInfo:
        started = time.monotonic()
        first = next(parts, None)
        if first is None or first.manifest is None:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the first Publish message must be the manifest")
        manifest = first.manifest
        self._check_manifest(manifest, context)
        if not self._publish_lock.acquire(timeout=self.publish_wait):
            self._refuse(context, grpc.StatusCode.ABORTED,
                         f"another publish held the registry for {self.publish_wait:.0f}s; retry")
        try:
            with self._lock:
                existing = self._versions.get(manifest.version)
                if existing is None and manifest.version <= self.latest():
                    self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION,
                                 f"version {manifest.version} is not newer than the latest {self.latest()}")
            if existing is not None:
                return self._republish(existing, manifest, parts, context)
            return self._publish_new(manifest, parts, context, started)
        finally:
            self._publish_lock.release()

    def _refuse(self, context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        PUBLISH_FAILURES.labels(code.name.lower()).inc()
        abort(context, code, message)

    def _check_manifest(self, manifest: pb.VersionInfo, context: grpc.ServicerContext) -> None:
        if manifest.version == 0:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "version must be >= 1")
        if manifest.size_bytes > self.max_model_bytes:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"size_bytes {manifest.size_bytes} exceeds the registry limit {self.max_model_bytes}")
        if manifest.sha256:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                         "leave the manifest's sha256 empty: the sha256 goes in the last Publish message")
        bad = [t for t in manifest.tags if t not in RESERVED_TAGS and not TAG_RE.match(t)]
        if bad:
            self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, f"invalid tags {bad}")

    def _receive(self, manifest: pb.VersionInfo, parts: Iterator[wire.PublishPart], context: grpc.ServicerContext,
                 sink: Callable[[memoryview, int], None]) -> str:
        """Read every chunk, hand each to sink(chunk, offset), check the size and the sha256 sent last,
        and return it."""
        digest = hashlib.sha256()
        size = 0
        declared: str | None = None
        for part in parts:
            if declared is not None:
                raise PayloadFailed(grpc.StatusCode.INVALID_ARGUMENT, "nothing may follow the sha256 message")
            if part.sha256 is not None:
                declared = part.sha256
                continue
            if part.chunk is None:
                raise PayloadFailed(grpc.StatusCode.INVALID_ARGUMENT, "only one manifest per Publish")
            n = len(part.chunk)
            if size + n > manifest.size_bytes:
                raise PayloadFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"received more than the declared size_bytes {manifest.size_bytes}")
            digest.update(part.chunk)
            sink(part.chunk, size)
            size += n
            BYTES_PUBLISHED.inc(n)
        if not context.is_active():
            raise PayloadFailed(grpc.StatusCode.ABORTED, "the publisher went away")
        if size != manifest.size_bytes:
            raise PayloadFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"received {size} bytes, manifest declares {manifest.size_bytes}")
        if declared is None or not SHA_RE.match(declared):
            raise PayloadFailed(grpc.StatusCode.INVALID_ARGUMENT, "the last Publish message must be the sha256 of "
                                f"the bytes, 64 lowercase hex digits (got {declared!r}); nothing stored")
        if digest.hexdigest() != declared:
            raise PayloadFailed(grpc.StatusCode.DATA_LOSS, f"sha256 mismatch: received bytes hash to "
                                f"{digest.hexdigest()}, the publisher declared {declared}; nothing stored")
        return declared

    def _republish(self, existing: pb.VersionInfo, manifest: pb.VersionInfo, parts: Iterator[wire.PublishPart],
                   context: grpc.ServicerContext) -> pb.VersionInfo:
        """A retried publish of a stored version: idempotent when the bytes are the same."""
        try:
            sha256 = self._receive(manifest, parts, context, lambda chunk, offset: None)
        except PayloadFailed as err:
            self._refuse(context, err.code, str(err))
        if existing.sha256 != sha256:
            self._refuse(context, grpc.StatusCode.ALREADY_EXISTS, f"version {manifest.version} exists with other weights")
        with self._lock:
            return self._info(manifest.version)

    def _publish_new(self, manifest: pb.VersionInfo, parts: Iterator[wire.PublishPart],
                     context: grpc.ServicerContext, started: float) -> pb.VersionInfo:
        info = pb.VersionInfo()
        info.CopyFrom(manifest)
        info.created_unix = time.time()
        payload = Payload(info, self.chunk_size, self.largest_message)
        with self._lock:
            previous_head = self._head
            self._inflight = payload
            self._cache[info.version] = payload
            if self._watchers:
                self._pushes[info.version] = _Push(started, time.time() - (time.monotonic() - started),
                                                   set(self._watchers), len(self._watchers))
                self._trim_pushes()
            if self.cut_through:
                self._head = payload
                self._lock.notify_all()  # Watch streams announce it now; Fetch streams it as it arrives

        try:
            try:
                info.sha256 = self._receive(manifest, parts, context, lambda chunk, offset: payload.feed(chunk))
            except grpc.RpcError as err:  # the request stream broke
                raise PayloadFailed(grpc.StatusCode.ABORTED, f"the publish stream broke: {err}") from None
            payload.mark(VERIFIED)  # watchers may swap it in from here on
            if not self.cut_through:
                with self._lock:
                    self._head = payload
                    self._lock.notify_all()  # Watch streams announce it now
            # blob first, then manifest: a version is listed only once its weights are stored
            self._store(weights_key(info.version), payload)
            with self._lock:
                self._versions[info.version] = info
                for tag in manifest.tags:
                    if tag not in RESERVED_TAGS:
                        old = self._tags.get(tag)
                        self._tags[tag] = info.version
                        if old is not None and old != info.version and old in self._versions:
                            self.blobs.put(manifest_key(old), self._manifest_bytes(old))
                self.blobs.put(manifest_key(info.version), self._manifest_bytes(info.version))
                if any(t not in RESERVED_TAGS for t in manifest.tags):
                    self._save_tags()
                self._inflight = None
                for version in [v for v in self._cache if v != info.version]:
                    del self._cache[version]
                self._retain()
                LATEST.set(self.latest())
                self._lock.notify_all()
                out = self._info(info.version)
        except BaseException as err:
            failure = err if isinstance(err, PayloadFailed) else PayloadFailed(
                grpc.StatusCode.UNAVAILABLE, f"storing version {info.version} failed: {err}")
            payload.mark(FAILED, failure)
            with self._lock:
                if self._head is payload:
                    self._head = previous_head
                self._inflight = None
                self._cache.pop(info.version, None)
                self._pushes.pop(info.version, None)
                self._lock.notify_all()
            PUBLISH_FAILURES.labels(failure.code.name.lower()).inc()
            log.warning("publish of version %d failed: %s", info.version, failure)
            if isinstance(err, Exception):
                abort(context, failure.code, str(failure))
            raise
        PUBLISH_SECONDS.observe(time.monotonic() - started)
        log.info("published version %d (%d bytes) in %.2fs", info.version, info.size_bytes, time.monotonic() - started)
        return out

    # -- fetch ------------------------------------------------------------------------------------
    def _resolve(self, version: int, tag: str, context: grpc.ServicerContext) -> int:
        with self._lock:
            if version == 0:
                version = self.latest() if tag in ("", "latest") else self._tags.get(tag, 0)
                if version == 0:
                    abort(context, grpc.StatusCode.NOT_FOUND, f"no version tagged {tag!r}" if tag else "no version published yet")
            if version not in self._versions and version not in self._cache:
                abort(context, grpc.StatusCode.NOT_FOUND, f"version {version} does not exist (or was not retained)")
            return version

    def _payload(self, version: int, context: grpc.ServicerContext) -> Payload:
        with self._lock:
            found = self._cache.get(version)
        if found is not None:
            return found
        with self._load_lock:  # one blob read however many watchers ask at once
            with self._lock:
                found = self._cache.get(version)
                info = self._info(version) if version in self._versions else None
            if found is not None:
                return found
            if info is None:
                abort(context, grpc.StatusCode.NOT_FOUND, f"version {version} is no longer retained")
            try:
                data = self.blobs.get(weights_key(version))
            except (KeyError, FileNotFoundError):
                abort(context, grpc.StatusCode.DATA_LOSS, f"the weights of version {version} are missing from the store")
            if len(data) != info.size_bytes or hashlib.sha256(data).hexdigest() != info.sha256:
                abort(context, grpc.StatusCode.DATA_LOSS, f"the stored weights of version {version} are corrupted")
            payload = Payload(info, self.chunk_size, self.largest_message).complete(data)
            del data
            with self._lock:
                if version == self.latest():  # keep the latest in memory: every watcher fetches it
                    self._cache[version] = payload
                    if self._head is not None and self._head.info.version == version:
                        payload.seq = self._head.seq
                        self._head = payload
            return payload

    def fetch_messages(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The Fetch stream as encoded WeightsChunk messages (the bytes the generated serializer would make)."""
        version = self._resolve(request.version, request.tag, context)
        payload = self._payload(version, context)
        precision = request.precision
        try:
            if precision:
                weights.half_dtype(precision)  # ValueError for unknown names
                payload = payload.variant(precision.lower(), context.is_active)
        except ValueError as err:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except PayloadFailed as err:
            abort(context, err.code, str(err))
        FETCHES.labels(precision or "stored").inc()
        offset, size, step = request.offset, payload.size, payload.chunk_size
        if offset > size:
            abort(context, grpc.StatusCode.OUT_OF_RANGE, f"offset {offset} is past the end ({size})")
        if request.chunk_size and request.chunk_size != step:
            least = -(-(size - offset) // MAX_FETCH_MESSAGES)
            if request.chunk_size < least:
                abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                      f"chunk_size {request.chunk_size} would cut the {size - offset} bytes into more than "
                      f"{MAX_FETCH_MESSAGES} messages: use 0 (the registry's, {step}) or at least {least}")
        with self._lock:
            info = self._info(version) if version in self._versions else payload.info
        if precision:
            info = payload.info
        sent_without_sha256 = not info.sha256
        yield wire.encode_info_chunk(info, offset)
        try:
            index = payload.index_of(offset, context.is_active) if request.chunk_size in (0, step) else None
            if index is not None:
                while (message := payload.wait_chunk(index, context.is_active)) is not None:
                    BYTES_PUSHED.inc(len(message) - payload.header_lens[index])
                    yield message
                    index += 1
            else:  # an offset inside a message, or another chunk size: from the complete payload
                payload.wait_verified(context.is_active)
                chunk = request.chunk_size or step
                for start in range(offset, size, chunk):
                    data = payload.raw(start, min(start + chunk, size))
                    BYTES_PUSHED.inc(len(data))
                    yield wire.encode_chunk(start, data)
            # the stream ends OK only once the whole version is verified: a watcher swaps only then
            payload.wait_verified(context.is_active)
            if sent_without_sha256:  # the info went out before the publish ended (cut-through): all of it now
                yield wire.encode_info_chunk(payload.info, size)
        except PayloadFailed as err:
            abort(context, err.code, str(err))

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightsChunk]:
        # Registered through the generated add_ModelRegistryServicer_to_server: the same stream, parsed
        # back into messages for the generated serializer. add_to_server skips this round trip.
        for message in self.fetch_messages(request, context):
            yield pb.WeightsChunk.FromString(message)

    # -- watch and acknowledgements ------------------------------------------------------------------
    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.VersionInfo]:
        watcher = request.watcher_id or context.peer()
        known = request.known_version
        with self._lock:
            self._watchers[watcher] = self._watchers.get(watcher, 0) + 1
            if known and self._running.get(watcher, 0) < known:
                self._running[watcher] = known
            self._update_watcher_gauges()

        def wake() -> None:
            with self._lock:
                self._lock.notify_all()

        context.add_callback(wake)
        sent_seq, sent_version = -1, known
        last_write = time.monotonic()
        try:
            while True:
                with self._lock:
                    while True:
                        if self._stopping or not context.is_active():
                            return
                        head = self._head
                        if head is not None and head.seq != sent_seq:
                            version = head.info.version
                            # the first message tells where the registry is; then a newer version, or the
                            # same version published again after a failed attempt
                            if (version != known) if sent_seq == -1 else (version >= sent_version):
                                info = self._info(version) if version in self._versions else head.info
                                sent_seq, sent_version = head.seq, version
                                break
                            sent_seq = head.seq
                        idle = time.monotonic() - last_write
                        if idle >= self.keepalive:
                            # gRPC servers refuse client keep-alive pings on a stream that sends nothing
                            # (GOAWAY "too_many_pings"): repeat the last announcement now and then
                            info = pb.VersionInfo(version=max(sent_version, 0))
                            break
                        self._lock.wait(min(5.0, self.keepalive - idle))
                last_write = time.monotonic()
                yield info
        finally:
            with self._lock:
                self._watchers[watcher] -= 1
                if not self._watchers[watcher]:
                    del self._watchers[watcher]
                    self._running.pop(watcher, None)
                    for number, push in list(self._pushes.items()):
                        if watcher in push.waiting:
                            push.waiting.discard(watcher)
                            push.watchers_left.add(watcher)
                            self._maybe_finish(number, push)
                self._update_watcher_gauges()

    def AckVersion(self, request: pb.AckVersionRequest, context: grpc.ServicerContext) -> pb.AckVersionResponse:
        now = time.monotonic()
        with self._lock:
            watcher, version = request.watcher_id, request.version
            if watcher in self._watchers and self._running.get(watcher, 0) != version:
                self._running[watcher] = version
                self._update_watcher_gauges()
            # acknowledging a version also acknowledges the older ones it skipped
            for number, push in list(self._pushes.items()):
                if number <= version and watcher in push.waiting:
                    push.waiting.discard(watcher)
                    push.acked += 1
                    push.finished = now
                    self._maybe_finish(number, push)
        return pb.AckVersionResponse()

    def _maybe_finish(self, version: int, push: _Push) -> None:
        """Observe the push latency once every watcher of the push acknowledged (or left)."""
        if not push.complete or push.observed:
            return
        push.observed = True
        self._lock.notify_all()
        if push.acked:
            latency = push.finished - push.started
            PUSH_LATENCY.observe(latency)
            LAST_PUSH_LATENCY.set(latency)
            log.info("version %d reached %d/%d watchers in %.3fs (%d left)", version, push.acked, push.expected,
                     latency, len(push.watchers_left))

    def _trim_pushes(self) -> None:
        for version in sorted(self._pushes)[:-PUSH_HISTORY]:
            del self._pushes[version]

    def _update_watcher_gauges(self) -> None:
        WATCHERS.set(len(self._watchers))
        counts: dict[int, int] = {}
        for watcher in self._watchers:
            version = self._running.get(watcher, 0)
            counts[version] = counts.get(version, 0) + 1
        WORKERS_PER_VERSION.clear()
        for version, n in counts.items():
            WORKERS_PER_VERSION.labels(str(version)).set(n)

    def _workers_per_version(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for watcher in self._watchers:
            version = self._running.get(watcher, 0)
            counts[version] = counts.get(version, 0) + 1
        return counts

    def GetPushStatus(self, request: pb.PushStatusRequest, context: grpc.ServicerContext) -> pb.PushStatus:
        deadline = time.monotonic() + max(0.0, request.wait_seconds)
        with self._lock:
            version = request.version or self.latest()
            while True:
                push = self._pushes.get(version)
                done = push is None or push.complete
                if done or self._stopping or not context.is_active():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, 1.0))
            out = pb.PushStatus(version=version, connected_watchers=len(self._watchers),
                                workers_per_version=self._workers_per_version())
            if push is None:
                out.complete = version in self._versions or version == 0
            else:
                out.watchers, out.acked, out.complete = push.expected, push.acked, push.complete
                out.published_unix = push.started_unix
                if push.complete and push.acked:
                    out.push_seconds = push.finished - push.started
                    out.last_ack_unix = push.started_unix + out.push_seconds
            return out

    # -- listing and tags -----------------------------------------------------------------------------
    def ListVersions(self, request: pb.ListVersionsRequest, context: grpc.ServicerContext) -> pb.ListVersionsResponse:
        with self._lock:
            return pb.ListVersionsResponse(versions=[self._info(v) for v in sorted(self._versions)])

    def SetTag(self, request: pb.SetTagRequest, context: grpc.ServicerContext) -> pb.VersionInfo:
        if request.tag in RESERVED_TAGS or not TAG_RE.match(request.tag):
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"tag must match {TAG_RE.pattern} and not be one of {sorted(RESERVED_TAGS)}")
        if request.remove:
            with self._lock:
                old = self._tags.pop(request.tag, None)
                if old is None:
                    abort(context, grpc.StatusCode.NOT_FOUND, f"no version tagged {request.tag!r}")
                self._save_tags()
                if old in self._versions:
                    self.blobs.put(manifest_key(old), self._manifest_bytes(old))
                    return self._info(old)
                return pb.VersionInfo()
        version = self._resolve(request.version, "", context)
        with self._lock:
            if version not in self._versions:
                abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"version {version} is still being published")
            old = self._tags.get(request.tag)
            self._tags[request.tag] = version
            self._save_tags()
            self.blobs.put(manifest_key(version), self._manifest_bytes(version))
            if old is not None and old != version and old in self._versions:
                self.blobs.put(manifest_key(old), self._manifest_bytes(old))
            return self._info(version)


def _identity(message: bytes) -> bytes:
    return message


def add_to_server(service: ModelRegistryService, server: Any) -> None:
    """Like the generated add_ModelRegistryServicer_to_server, but Publish reads chunks as views into
    the received messages and Fetch sends pre-encoded chunks: no per-watcher copy in Python."""
    captured: dict[str, Any] = {}

    class _Capture:
        def add_generic_rpc_handlers(self, handlers: Iterable[Any]) -> None:
            pass

        def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
            captured.update(handlers)

    model_registry_pb2_grpc.add_ModelRegistryServicer_to_server(service, _Capture())
    captured["Publish"] = grpc.stream_unary_rpc_method_handler(
        service.publish_parts, request_deserializer=wire.decode_publish,
        response_serializer=pb.VersionInfo.SerializeToString)
    captured["Fetch"] = grpc.unary_stream_rpc_method_handler(
        service.fetch_messages, request_deserializer=pb.FetchRequest.FromString, response_serializer=_identity)
    name = "overworld.v1.ModelRegistry"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, captured),))
    server.add_registered_method_handlers(name, captured)


def registration(service: ModelRegistryService) -> tuple[Callable[[Any, Any], None], ModelRegistryService, str]:
    """The (add, servicer, name) triple for overworld.core.grpc_util.serve."""
    return add_to_server, service, "overworld.v1.ModelRegistry"
