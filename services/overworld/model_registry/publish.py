"""The publish path: a version's manifest, then its bytes (hashed as they arrive, fed to the watchers
already with cut-through), then the sha256 the publisher declares; once it matches, the version is
announced, stored (weights, then manifest) and listed."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Iterator
from typing import NoReturn

import grpc
from prometheus_client import Counter, Histogram

from overworld.core.grpc_util import Refused
from overworld.model_registry import wire
from overworld.model_registry.payload import FAILED, VERIFIED, Payload, PayloadFailed
from overworld.model_registry.store import (
    CACHED_VERSIONS,
    LATEST,
    RESERVED_TAGS,
    TAG_RE,
    RegistryStore,
    log,
    manifest_key,
    weights_key,
)
from overworld.v1 import model_registry_pb2 as pb

PUBLISH_SECONDS = Histogram("overworld_registry_publish_seconds",
                            "Publish: manifest received to version stored and listed",
                            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
BYTES_PUBLISHED = Counter("overworld_registry_bytes_published_total", "Weight bytes received by Publish")
PUBLISH_FAILURES = Counter("overworld_registry_publish_failures_total", "Publishes refused or broken", ["reason"])

SHA_RE = re.compile(r"^[0-9a-f]{64}$")


class Publishing(RegistryStore):
    def Publish(self, request_iterator: Iterator[pb.PublishRequest], context: grpc.ServicerContext) -> pb.VersionInfo:
        return self.publish_parts((wire.publish_part(r) for r in request_iterator), context)

    def publish_parts(self, parts: Iterator[wire.PublishPart], context: grpc.ServicerContext) -> pb.VersionInfo:
        """The gRPC Publish of parts decoded without a copy (server.add_to_server)."""
        return self.publish_from(parts, context.is_active)

    def publish_from(self, parts: Iterator[wire.PublishPart], is_active: Callable[[], bool]) -> pb.VersionInfo:
        """Publish the version `parts` carry (from gRPC or the weights stream; `is_active`: whether the
        publisher is still there). Raises Refused with the status to answer."""
        started = time.monotonic()
        first = next(parts, None)
        if first is None or first.manifest is None:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, "the first Publish message must be the manifest")
        manifest = first.manifest
        self.check_manifest(manifest)
        if not self._publish_lock.acquire(timeout=self.publish_wait):
            self._refuse(grpc.StatusCode.ABORTED,
                         f"another publish held the registry for {self.publish_wait:.0f}s; retry")
        try:
            with self._lock:
                existing = self._versions.get(manifest.version)
                if existing is None and manifest.version <= self.latest():
                    self._refuse(grpc.StatusCode.FAILED_PRECONDITION,
                                 f"version {manifest.version} is not newer than the latest {self.latest()}")
            if existing is not None:
                return self._republish(existing, manifest, parts, is_active)
            return self._publish_new(manifest, parts, is_active, started)
        finally:
            self._publish_lock.release()

    def _refuse(self, code: grpc.StatusCode, message: str) -> NoReturn:
        PUBLISH_FAILURES.labels(code.name.lower()).inc()
        raise Refused(code, message)

    def check_manifest(self, manifest: pb.VersionInfo) -> None:
        """Refuse a manifest that cannot be published (Refused), before its bytes are read."""
        if manifest.version == 0:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, "version must be >= 1")
        if manifest.size_bytes > self.max_model_bytes:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                         f"size_bytes {manifest.size_bytes} exceeds the registry limit {self.max_model_bytes}")
        if manifest.sha256:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT,
                         "leave the manifest's sha256 empty: the sha256 goes in the last Publish message")
        bad = [t for t in manifest.tags if t not in RESERVED_TAGS and not TAG_RE.match(t)]
        if bad:
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, f"invalid tags {bad}")
        with self._lock:
            if manifest.version not in self._versions and manifest.version <= self.latest():
                self._refuse(grpc.StatusCode.FAILED_PRECONDITION,
                             f"version {manifest.version} is not newer than the latest {self.latest()}")

    def _receive(self, manifest: pb.VersionInfo, parts: Iterator[wire.PublishPart], is_active: Callable[[], bool],
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
        if not is_active():
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
                   is_active: Callable[[], bool]) -> pb.VersionInfo:
        """A retried publish of a stored version: idempotent when the bytes are the same."""
        try:
            sha256 = self._receive(manifest, parts, is_active, lambda chunk, offset: None)
        except PayloadFailed as err:
            self._refuse(err.code, str(err))
        if existing.sha256 != sha256:
            self._refuse(grpc.StatusCode.ALREADY_EXISTS, f"version {manifest.version} exists with other weights")
        with self._lock:
            return self._info(manifest.version)

    def _publish_new(self, manifest: pb.VersionInfo, parts: Iterator[wire.PublishPart],
                     is_active: Callable[[], bool], started: float) -> pb.VersionInfo:
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
                info.sha256 = self._receive(manifest, parts, is_active, lambda chunk, offset: payload.feed(chunk))
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
                raise failure from None
            raise
        PUBLISH_SECONDS.observe(time.monotonic() - started)
        log.info("published version %d (%d bytes) in %.2fs", info.version, info.size_bytes, time.monotonic() - started)
        return out
