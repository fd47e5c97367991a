"""The model-registry: versioned weights (safetensors + JSON manifest) in the blob store, tags,
retention, and a watch stream that pushes every new version to subscribed rollout workers.

How a version travels (docs/model_registry.md has the whole story):

1. Publish (client-streamed): the manifest first, then the bytes, hashed as they arrive.
2. Once every byte has arrived and its sha256 matches the one the publisher sent last, the version is
   *announced* on every Watch stream (with `cut_through`, already when the manifest arrives, its bytes
   streamed to the watchers as they arrive). Each announcement says where the watcher fetches it from:
   by relay (the default), stripes from other workers as planned in `relay_plan.py`, the registry
   itself sending each stripe once; else (`relay_fanout=0`, or a watcher that cannot relay and has no
   relay to fetch from) the whole version from the registry. A watcher swaps in only bytes whose
   sha256 matches the one the registry announced.
3. The weights blob, then the manifest, are written to the blob store; the version is listed (and
   `latest`) once its manifest is written, and Publish returns. On restart the index is rebuilt from
   the manifests.

Each chunk of a version is encoded once as a WeightsChunk message and the same bytes object is sent
to every watcher (`payload.py`, `wire.py`); the latest version stays in memory, so a fetch reads no
blob. `pushes.py` follows the acknowledgements.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict, ParseDict
from prometheus_client import Counter, Gauge, Histogram

from overworld.core import weights
from overworld.core.blobs import BlobStore
from overworld.core.grpc_util import abort, add_overriding
from overworld.model_registry import wire
from overworld.model_registry.payload import (
    ALIGN,
    DEFAULT_CHUNK,
    FAILED,
    LARGEST_MESSAGE,
    MAX_FETCH_MESSAGES,
    VERIFIED,
    Payload,
    PayloadFailed,
    message_bounds,
)
from overworld.model_registry.pushes import PushTracker
from overworld.model_registry.relay_plan import Member, RelayPlan, relay_chunk_bytes
from overworld.v1 import model_registry_pb2 as pb
from overworld.v1 import model_registry_pb2_grpc

log = logging.getLogger("overworld.model_registry")

LATEST = Gauge("overworld_registry_latest_version", "Latest published model version")
PUBLISH_SECONDS = Histogram("overworld_registry_publish_seconds",
                            "Publish: manifest received to version stored and listed",
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
BYTES_PUSHED = Counter("overworld_registry_bytes_pushed_total", "Weight bytes sent by Fetch")
BYTES_PUBLISHED = Counter("overworld_registry_bytes_published_total", "Weight bytes received by Publish")
FETCHES = Counter("overworld_registry_fetches_total", "Fetch streams started", ["precision"])
PUBLISH_FAILURES = Counter("overworld_registry_publish_failures_total", "Publishes refused or broken", ["reason"])

RESERVED_TAGS = {"latest"}
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
SHA_RE = re.compile(r"^[0-9a-f]{64}$")
HOST_RE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}[A-Za-z0-9])?)*")
TAGS_KEY = "models/tags.json"
DEFAULT_RELAY_FANOUT = 2
MAX_RELAY_FANOUT = 64  # the stripes a worker takes (rollout_worker.relay.MAX_STRIPES)
RELAY_PLANS_KEPT = 4  # (version, precision) plans kept for watchers that connect during a push
CACHED_VERSIONS = 2  # the latest version's messages and the one before stay in memory

__all__ = ["DEFAULT_CHUNK", "LARGEST_MESSAGE", "ModelRegistryService", "Payload", "message_bounds", "registration"]


def weights_key(version: int) -> str:
    return f"models/{version:010d}/weights.safetensors"


def manifest_key(version: int) -> str:
    return f"models/{version:010d}/manifest.json"


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:10.0.0.5:41234" -> "10.0.0.5", "ipv6:%5B::1%5D:5" -> "[::1]");
    "" for a peer that has no network address (a Unix socket)."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return ""
    host, _, _ = urllib.parse.unquote(rest).rpartition(":")
    return host


def relay_host(text: str) -> str:
    """A watcher's own relay host, checked: an IP address ("[...]" around IPv6) or a DNS name."""
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        if not HOST_RE.fullmatch(text):
            raise ValueError(f"relay_host {text[:80]!r} is neither an IP address nor a host name") from None
        return text
    return f"[{address}]" if address.version == 6 else str(address)


class ModelRegistryService(model_registry_pb2_grpc.ModelRegistryServicer):
    def __init__(self, blobs: BlobStore, retain: int = 20, max_model_bytes: int = 8 << 30,
                 chunk_size: int = DEFAULT_CHUNK, largest_message: int = LARGEST_MESSAGE, publish_wait: float = 120.0,
                 keepalive: float = 15.0, cut_through: bool = False,
                 relay_fanout: int = DEFAULT_RELAY_FANOUT) -> None:
        if not 0 <= relay_fanout <= MAX_RELAY_FANOUT:
            raise ValueError(f"relay_fanout must be 0 (every watcher fetches from the registry) to {MAX_RELAY_FANOUT}, "
                             f"not {relay_fanout}")
        if cut_through and relay_fanout:
            raise ValueError("cut-through announces a version before its sha256 is known, and relays need it to "
                             "check what they pass on: use it with relay_fanout 0 (the star)")
        self.blobs = blobs
        self.retain = max(1, retain)
        self.max_model_bytes = max_model_bytes
        self.chunk_size = chunk_size
        self.largest_message = largest_message
        self.publish_wait = publish_wait
        self.keepalive = keepalive
        self.cut_through = cut_through
        self.relay_fanout = relay_fanout
        self._lock = threading.Condition()
        self._publish_lock = threading.Lock()
        self._load_lock = threading.Lock()
        self._versions: dict[int, pb.VersionInfo] = {}
        self._tags: dict[str, int] = {}
        self._head: Payload | None = None  # the newest version: being published, or the latest stored
        self._inflight: Payload | None = None
        self._cache: dict[int, Payload] = {}  # the latest stored version (and the one being published)
        self._pushes = PushTracker(self._lock)
        self._plans: dict[tuple[int, str], RelayPlan] = {}  # (version, precision) -> its relay plan
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
            self._pushes.start(info.version, started, time.time() - (time.monotonic() - started))
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
                for version in sorted(self._cache)[:-CACHED_VERSIONS]:
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
                self._pushes.drop(info.version)
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

    def _payload(self, version: int) -> Payload:
        """The messages of `version`: from memory (the newest ones), else read from the store and checked.
        PayloadFailed (NOT_FOUND, DATA_LOSS) when it cannot be had."""
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
                raise PayloadFailed(grpc.StatusCode.NOT_FOUND, f"version {version} is no longer retained")
            try:
                data = self.blobs.get(weights_key(version))
            except (KeyError, FileNotFoundError):
                raise PayloadFailed(grpc.StatusCode.DATA_LOSS,
                                    f"the weights of version {version} are missing from the store") from None
            if len(data) != info.size_bytes or hashlib.sha256(data).hexdigest() != info.sha256:
                raise PayloadFailed(grpc.StatusCode.DATA_LOSS, f"the stored weights of version {version} are corrupted")
            payload = Payload(info, self.chunk_size, self.largest_message).complete(data)
            del data
            with self._lock:
                # keep the newest versions in memory: every watcher fetches them (the one before the
                # latest too: its relays may still be re-attaching while the next is pushed)
                if version >= max(self._versions, default=0) - 1 and len(self._cache) < CACHED_VERSIONS:
                    self._cache[version] = payload
                    if self._head is not None and self._head.info.version == version:
                        payload.seq = self._head.seq
                        self._head = payload
            return payload

    def fetch_messages(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The Fetch stream as encoded WeightsChunk messages (the bytes the generated serializer would make)."""
        version = self._resolve(request.version, request.tag, context)
        precision = request.precision
        try:
            payload = self._payload(version)
            if precision:
                weights.half_dtype(precision)  # ValueError for unknown names
                payload = payload.variant(precision.lower(), context.is_active)
        except ValueError as err:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except PayloadFailed as err:
            abort(context, err.code, str(err))
        FETCHES.labels(precision or "stored").inc()
        offset, size, step = request.offset, payload.size, payload.chunk_size
        end = offset + request.limit if request.limit else size
        if offset > size or end > size:
            abort(context, grpc.StatusCode.OUT_OF_RANGE,
                  f"bytes {offset}..{end} are past the end of version {version} ({size} bytes)")
        chunk = request.chunk_size or step
        if chunk != step:
            least = -(-(end - offset) // MAX_FETCH_MESSAGES)
            if chunk < least:
                abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                      f"chunk_size {chunk} would cut the {end - offset} bytes into more than "
                      f"{MAX_FETCH_MESSAGES} messages: use 0 (the registry's, {step}) or at least {least}")
        with self._lock:
            info = self._info(version) if version in self._versions else payload.info
        if precision:
            info = payload.info
        sent_without_sha256 = not info.sha256
        yield wire.encode_info_chunk(info, offset)
        try:
            # the registry's own messages (cut at tensor boundaries) only when the caller left the size to
            # it: a relay asks for messages of exactly chunk_size bytes, whatever the registry's size is
            index = (payload.index_of(offset, context.is_active)
                     if not request.chunk_size and not request.limit else None)
            if index is not None:
                while (message := payload.wait_chunk(index, context.is_active)) is not None:
                    BYTES_PUSHED.inc(len(message) - payload.header_lens[index])
                    yield message
                    index += 1
            else:  # an offset inside a message, another chunk size, a limit: from the complete payload
                payload.wait_verified(context.is_active)
                for start in range(offset, end, chunk):
                    data = payload.raw(start, min(start + chunk, end))
                    BYTES_PUSHED.inc(len(data))
                    yield wire.encode_chunk(start, data, ALIGN)
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

    # -- watch, relay plans and acknowledgements ------------------------------------------------------
    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.VersionInfo]:
        """The star's watch (and an older release's watchers): every version to fetch from here."""
        for announcement in self._watch(request, context, relayed=False):
            yield announcement.info

    def WatchAnnouncements(self, request: pb.WatchRequest, context: grpc.ServicerContext
                           ) -> Iterator[pb.Announcement]:
        yield from self._watch(request, context, relayed=True)

    def _watch(self, request: pb.WatchRequest, context: grpc.ServicerContext, relayed: bool
               ) -> Iterator[pb.Announcement]:
        watcher = request.watcher_id or context.peer()
        known = request.known_version
        try:
            precision = request.precision.lower()
            weights.half_dtype(precision)
        except ValueError as err:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"WatchRequest.precision: {err}")
        if request.relay_port > 65535:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"relay_port {request.relay_port} is not a TCP port")
        try:
            own = relay_host(request.relay_host) if request.relay_host else ""
        except ValueError as err:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"WatchRequest.{err}")
        host = (own or peer_host(context.peer())) if request.relay_port and relayed else ""
        member = Member(watcher, f"{host}:{request.relay_port}" if host else "", precision, relayed)
        with self._lock:
            self._pushes.joined(member, known)

        def wake() -> None:
            with self._lock:
                self._lock.notify_all()

        context.add_callback(wake)
        sent_seq, sent_version = -1, known
        last_write = time.monotonic()
        try:
            while True:
                head: Payload | None = None
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
                                sent_seq, sent_version = head.seq, version
                                break
                            sent_seq = head.seq
                        head = None
                        idle = time.monotonic() - last_write
                        if idle >= self.keepalive:
                            # gRPC servers refuse client keep-alive pings on a stream that sends nothing
                            # (GOAWAY "too_many_pings"): repeat the last announcement now and then
                            break
                        self._lock.wait(min(5.0, self.keepalive - idle))
                if head is None:
                    announcement: pb.Announcement | None = pb.Announcement(
                        info=pb.VersionInfo(version=max(sent_version, 0)))
                else:
                    announcement = self._announcement(head, member, context)
                if announcement is not None:
                    last_write = time.monotonic()
                    yield announcement
        finally:
            with self._lock:
                self._pushes.left(watcher)

    def _announcement(self, head: Payload, member: Member, context: grpc.ServicerContext) -> pb.Announcement | None:
        """The announcement of `head` to one watcher: the info of the bytes it will receive (in its
        precision) and, by relay, where each stripe comes from. None if the version cannot be sent in
        that precision (its publish failed meanwhile, or it does not convert): nothing to announce."""
        version = head.info.version
        with self._lock:
            info = self._info(version) if version in self._versions else head.info
        if not self.relay_fanout or not member.relayed or not info.sha256:
            return pb.Announcement(info=info)  # the star; or cut-through, announced before its sha256
        if member.precision:  # the sha256 and size of what this watcher will receive
            try:
                info = self._payload(version).variant(member.precision, context.is_active).info
            except PayloadFailed as err:
                log.warning("not announcing version %d to %s: %s", version, member.watcher, err)
                return None
        with self._lock:
            key = (version, member.precision)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = RelayPlan(self._pushes.member_list(member.precision), self.relay_fanout)
                for old in sorted(self._plans)[:-RELAY_PLANS_KEPT]:
                    del self._plans[old]
            sources = plan.place(member)
        if not sources:
            return pb.Announcement(info=info)
        return pb.Announcement(info=info, sources=sources, chunk_bytes=relay_chunk_bytes(info.size_bytes))

    def AckVersion(self, request: pb.AckVersionRequest, context: grpc.ServicerContext) -> pb.AckVersionResponse:
        now = time.monotonic()
        with self._lock:
            self._pushes.ack(request.watcher_id, request.version, now)
        return pb.AckVersionResponse()

    def GetPushStatus(self, request: pb.PushStatusRequest, context: grpc.ServicerContext) -> pb.PushStatus:
        deadline = time.monotonic() + max(0.0, request.wait_seconds)
        with self._lock:
            version = request.version or self.latest()
            while True:
                push = self._pushes.pushes.get(version)
                if push is None or push.complete or self._stopping or not context.is_active():
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(min(left, 1.0))
            return self._pushes.status(version, version in self._versions)

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
    add_overriding(model_registry_pb2_grpc.add_ModelRegistryServicer_to_server, service, server,
                   "overworld.v1.ModelRegistry", {
                       "Publish": grpc.stream_unary_rpc_method_handler(
                           service.publish_parts, request_deserializer=wire.decode_publish,
                           response_serializer=pb.VersionInfo.SerializeToString),
                       "Fetch": grpc.unary_stream_rpc_method_handler(
                           service.fetch_messages, request_deserializer=pb.FetchRequest.FromString,
                           response_serializer=_identity)})


def registration(service: ModelRegistryService) -> tuple[Callable[[Any, Any], None], ModelRegistryService, str]:
    """The (add, servicer, name) triple for overworld.core.grpc_util.serve."""
    return add_to_server, service, "overworld.v1.ModelRegistry"
