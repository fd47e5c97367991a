"""The model-registry: versioned weights (safetensors + JSON manifest) in the blob store, tags,
and a watch stream that pushes every new version to subscribed rollout workers."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Iterator

import grpc
from google.protobuf.json_format import MessageToDict, ParseDict
from prometheus_client import Counter, Gauge, Histogram

from overworld.core.blobs import BlobStore
from overworld.core.grpc_util import abort
from overworld.v1 import model_registry_pb2 as pb
from overworld.v1 import model_registry_pb2_grpc

log = logging.getLogger("overworld.model_registry")

LATEST = Gauge("overworld_registry_latest_version", "Latest published model version")
PUBLISH_SECONDS = Histogram("overworld_registry_publish_seconds", "Time to receive and store one version")
PUSH_LATENCY = Histogram("overworld_registry_push_latency_seconds", "Publish to last watcher acknowledged",
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
BYTES_PUSHED = Counter("overworld_registry_bytes_pushed_total", "Weight bytes sent by Fetch")
WATCHERS = Gauge("overworld_registry_watchers", "Open watch streams")

DEFAULT_CHUNK = 1 << 20
RESERVED_TAGS = {"latest"}


def weights_key(version: int) -> str:
    return f"models/{version:010d}/weights.safetensors"


def manifest_key(version: int) -> str:
    return f"models/{version:010d}/manifest.json"


class ModelRegistryService(model_registry_pb2_grpc.ModelRegistryServicer):
    def __init__(self, blobs: BlobStore, retain: int = 20, max_model_bytes: int = 8 << 30) -> None:
        self.blobs = blobs
        self.retain = retain
        self.max_model_bytes = max_model_bytes
        self._lock = threading.Condition()
        self._versions: dict[int, pb.VersionInfo] = {}
        self._tags: dict[str, int] = {}
        self._watchers: set[str] = set()
        self._pending_acks: dict[int, tuple[float, set[str]]] = {}
        self._stopping = False
        self._load()

    def _load(self) -> None:
        """Rebuild the index from manifests: a version is listed only once its manifest is written."""
        for key in self.blobs.keys("models/"):
            if key.endswith("/manifest.json"):
                info = ParseDict(json.loads(self.blobs.get(key)), pb.VersionInfo())
                self._versions[info.version] = info
                for tag in info.tags:
                    self._tags[tag] = info.version
        if self._versions:
            LATEST.set(self.latest())
            log.info("loaded %d model versions, latest %d", len(self._versions), self.latest())

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

    def _write_manifest(self, version: int) -> None:
        info = self._info(version)
        del info.tags[:]
        info.tags.extend(sorted(t for t, v in self._tags.items() if v == version))
        self.blobs.put(manifest_key(version), json.dumps(MessageToDict(info)).encode())

    def Publish(self, request_iterator: Iterator[pb.PublishRequest], context: grpc.ServicerContext) -> pb.VersionInfo:
        started = time.monotonic()
        first = next(request_iterator, None)
        if first is None or not first.HasField("manifest"):
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the first Publish message must be the manifest")
        manifest = first.manifest
        if manifest.version == 0:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "version must be >= 1")
        if manifest.size_bytes > self.max_model_bytes:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                  f"size_bytes {manifest.size_bytes} exceeds the registry limit {self.max_model_bytes}")
        if len(manifest.sha256) != 64:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, "sha256 must be 64 hex digits")
        with self._lock:
            existing = self._versions.get(manifest.version)
            if existing is None and manifest.version <= self.latest():
                abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                      f"version {manifest.version} is not newer than the latest {self.latest()}")
        digest = hashlib.sha256()
        parts: list[bytes] = []
        size = 0
        for request in request_iterator:
            if not request.HasField("chunk"):
                abort(context, grpc.StatusCode.INVALID_ARGUMENT, "only one manifest per Publish")
            size += len(request.chunk)
            if size > manifest.size_bytes:
                abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                      f"received more than the declared size_bytes {manifest.size_bytes}")
            digest.update(request.chunk)
            parts.append(request.chunk)
        if size != manifest.size_bytes:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"received {size} bytes, manifest declares {manifest.size_bytes}")
        if digest.hexdigest() != manifest.sha256:
            abort(context, grpc.StatusCode.DATA_LOSS,
                  f"sha256 mismatch: received {digest.hexdigest()}, manifest declares {manifest.sha256}; nothing stored")
        if existing is not None:
            if existing.sha256 != manifest.sha256:
                abort(context, grpc.StatusCode.ALREADY_EXISTS, f"version {manifest.version} exists with other weights")
            return self._info(manifest.version)
        self.blobs.put(weights_key(manifest.version), b"".join(parts))
        info = pb.VersionInfo()
        info.CopyFrom(manifest)
        del info.tags[:]
        info.created_unix = time.time()
        with self._lock:
            self._versions[info.version] = info
            for tag in manifest.tags:
                if tag not in RESERVED_TAGS:
                    self._tags[tag] = info.version
            self._write_manifest(info.version)
            self._pending_acks[info.version] = (time.monotonic(), set(self._watchers))
            self._retain()
            LATEST.set(self.latest())
            self._lock.notify_all()
            out = self._info(info.version)
        PUBLISH_SECONDS.observe(time.monotonic() - started)
        return out

    def _retain(self) -> None:
        keep = set(sorted(self._versions)[-self.retain:]) | set(self._tags.values())
        for version in [v for v in self._versions if v not in keep]:
            del self._versions[version]
            self.blobs.delete([manifest_key(version), weights_key(version)])
            self._pending_acks.pop(version, None)

    def _resolve(self, version: int, tag: str, context: grpc.ServicerContext) -> int:
        with self._lock:
            if version == 0:
                version = self.latest() if tag in ("", "latest") else self._tags.get(tag, 0)
                if version == 0:
                    abort(context, grpc.StatusCode.NOT_FOUND, f"no version tagged {tag!r}" if tag else "no version published yet")
            if version not in self._versions:
                abort(context, grpc.StatusCode.NOT_FOUND, f"version {version} does not exist (or was not retained)")
            return version

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightsChunk]:
        version = self._resolve(request.version, request.tag, context)
        with self._lock:
            info = self._info(version)
        if request.offset > info.size_bytes:
            abort(context, grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} is past the end ({info.size_bytes})")
        data = self.blobs.get(weights_key(version))
        chunk = request.chunk_size or DEFAULT_CHUNK
        offset = request.offset
        yield pb.WeightsChunk(info=info, offset=offset, data=data[offset:offset + chunk])
        BYTES_PUSHED.inc(min(chunk, len(data) - offset))
        offset += chunk
        while offset < len(data):
            yield pb.WeightsChunk(offset=offset, data=data[offset:offset + chunk])
            BYTES_PUSHED.inc(min(chunk, len(data) - offset))
            offset += chunk

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.VersionInfo]:
        watcher = request.watcher_id or context.peer()
        known = request.known_version
        with self._lock:
            self._watchers.add(watcher)
            WATCHERS.set(len(self._watchers))
        try:
            while context.is_active():
                with self._lock:
                    if not self._stopping and self.latest() <= known:
                        self._lock.wait(1.0)
                    if self._stopping:
                        return
                    latest = self.latest()
                    info = self._info(latest) if latest > known else None
                if info is not None:
                    known = latest
                    yield info
        finally:
            with self._lock:
                self._watchers.discard(watcher)
                WATCHERS.set(len(self._watchers))

    def AckVersion(self, request: pb.AckVersionRequest, context: grpc.ServicerContext) -> pb.AckVersionResponse:
        with self._lock:
            pending = self._pending_acks.get(request.version)
            if pending:
                published, waiting = pending
                waiting.discard(request.watcher_id)
                if not waiting:
                    PUSH_LATENCY.observe(time.monotonic() - published)
                    del self._pending_acks[request.version]
        return pb.AckVersionResponse()

    def ListVersions(self, request: pb.ListVersionsRequest, context: grpc.ServicerContext) -> pb.ListVersionsResponse:
        with self._lock:
            return pb.ListVersionsResponse(versions=[self._info(v) for v in sorted(self._versions)])

    def SetTag(self, request: pb.SetTagRequest, context: grpc.ServicerContext) -> pb.VersionInfo:
        if not request.tag or request.tag in RESERVED_TAGS:
            abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"tag must be non-empty and not one of {sorted(RESERVED_TAGS)}")
        version = self._resolve(request.version, "", context)
        with self._lock:
            old = self._tags.get(request.tag)
            self._tags[request.tag] = version
            self._write_manifest(version)
            if old is not None and old != version and old in self._versions:
                self._write_manifest(old)
            return self._info(version)
