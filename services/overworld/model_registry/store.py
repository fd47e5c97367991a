"""The registry's state: the versions listed in the blob store (a manifest per version, weights first),
tags, retention, and the newest versions' messages in memory. The RPCs that change and read it are the
publish path (`publish.py`), the watch path (`announce.py`) and `server.py` (fetch, listing, tags)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading

import grpc
from google.protobuf.json_format import MessageToDict, ParseDict
from prometheus_client import Gauge

from overworld.core.blobs.store import BlobStore
from overworld.core.grpc_util import Refused
from overworld.model_registry.payload import VERIFIED, Payload, PayloadFailed
from overworld.model_registry.pushes import PushTracker
from overworld.model_registry.relay_plan import RelayExclusions, RelayPlan
from overworld.v1 import model_registry_pb2 as pb

log = logging.getLogger("overworld.model_registry")

LATEST = Gauge("overworld_registry_latest_version", "Latest published model version")

RESERVED_TAGS = {"latest"}
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TAGS_KEY = "models/tags.json"
CACHED_VERSIONS = 2  # the latest version's messages and the one before stay in memory


def weights_key(version: int) -> str:
    return f"models/{version:010d}/weights.safetensors"


def manifest_key(version: int) -> str:
    return f"models/{version:010d}/manifest.json"


class RegistryStore:
    """The versions, tags and cached payloads, and the locks that guard them (the service's base)."""

    def __init__(self, blobs: BlobStore, retain: int, max_model_bytes: int, chunk_size: int, largest_message: int,
                 publish_wait: float, keepalive: float, cut_through: bool, relay_fanout: int) -> None:
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
        self._exclusions = RelayExclusions()
        self.weights_port = 0  # the weights stream's (server.py starts it)
        self._spare: bytearray | None = None
        self._stopping = False

    # -- index and blob store ------------------------------------------------------------------------
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
        self.blobs.put(key, buf)
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

    # -- reading -----------------------------------------------------------------------------------
    def _resolve(self, version: int, tag: str, context: grpc.ServicerContext) -> int:
        with self._lock:
            if version == 0:
                version = self.latest() if tag in ("", "latest") else self._tags.get(tag, 0)
                if version == 0:
                    raise Refused(grpc.StatusCode.NOT_FOUND, f"no version tagged {tag!r}" if tag else "no version published yet")
            if version not in self._versions and version not in self._cache:
                raise Refused(grpc.StatusCode.NOT_FOUND, f"version {version} does not exist (or was not retained)")
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

