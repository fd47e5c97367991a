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

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import Counter

from overworld.core.blobs.store import BlobStore
from overworld.core.grpc_util import Refused, add_overriding
from overworld.core.security import authz
from overworld.core.wire import safetensors_format
from overworld.model_registry import wire
from overworld.model_registry.announce import Watching
from overworld.model_registry.payload import (
    ALIGN,
    DEFAULT_CHUNK,
    LARGEST_MESSAGE,
    MAX_FETCH_MESSAGES,
    Payload,
    PayloadFailed,
    message_bounds,
)
from overworld.model_registry.publish import Publishing
from overworld.model_registry.relay_plan import relay_chunk_bytes
from overworld.model_registry.store import RESERVED_TAGS, TAG_RE, manifest_key, weights_key
from overworld.model_registry.stream import publish as publish_stream
from overworld.model_registry.stream.envelope import StreamError
from overworld.model_registry.stream.protocol import FrameWriter
from overworld.model_registry.stream.server import WeightsStreamServer
from overworld.model_registry.worker.relay import check_range
from overworld.v1 import model_registry_pb2 as pb
from overworld.v1 import model_registry_pb2_grpc

BYTES_PUSHED = Counter("overworld_registry_bytes_pushed_total", "Weight bytes sent by Fetch")
FETCHES = Counter("overworld_registry_fetches_total", "Fetch streams started", ["precision"])

DEFAULT_RELAY_FANOUT = 2
MAX_RELAY_FANOUT = 64  # the stripes a worker takes (model_registry.worker.relay.MAX_STRIPES)

__all__ = ["DEFAULT_CHUNK", "LARGEST_MESSAGE", "ModelRegistryService", "Payload", "message_bounds", "registration",
           "weights_key"]


class ModelRegistryService(Publishing, Watching, model_registry_pb2_grpc.ModelRegistryServicer):
    def __init__(self, blobs: BlobStore, retain: int = 20, max_model_bytes: int = 8 << 30,
                 chunk_size: int = DEFAULT_CHUNK, largest_message: int = LARGEST_MESSAGE, publish_wait: float = 120.0,
                 keepalive: float = 15.0, cut_through: bool = False,
                 relay_fanout: int = DEFAULT_RELAY_FANOUT, weights_host: str = "127.0.0.1",
                 weights_port: int = 0, publish_port: int = 0) -> None:
        """`weights_host`/`weights_port`: where the weights stream listens (port 0: any free port; the
        announcements say which); `publish_port`: where the trainer publishes over it (port 0: any free
        port; GetPublishEndpoint says which)."""
        if not 0 <= relay_fanout <= MAX_RELAY_FANOUT:
            raise ValueError(f"relay_fanout must be 0 (every watcher fetches from the registry) to {MAX_RELAY_FANOUT}, "
                             f"not {relay_fanout}")
        if cut_through and relay_fanout:
            raise ValueError("cut-through announces a version before its sha256 is known, and relays need it to "
                             "check what they pass on: use it with relay_fanout 0 (the star)")
        super().__init__(blobs, retain, max_model_bytes, chunk_size, largest_message, publish_wait, keepalive,
                         cut_through, relay_fanout)
        self._load()
        self._weights = WeightsStreamServer(authz.WEIGHTS_FROM_REGISTRY, self.stream_fetch, weights_host, weights_port)
        self.weights_port = self._weights.port
        self._publishing = WeightsStreamServer(authz.WEIGHTS_PUBLISH, self.stream_publish, weights_host, publish_port,
                                               request_type=pb.VersionInfo, max_request=publish_stream.MAX_MANIFEST,
                                               admit=self.admit_publish, drain_on_error=True)
        self.publish_port = self._publishing.port

    def stop(self) -> None:
        super().stop()
        self._weights.stop()
        self._publishing.stop()

    # -- publish over the weights stream ------------------------------------------------------------
    def GetPublishEndpoint(self, request: pb.PublishEndpointRequest, context: grpc.ServicerContext
                           ) -> pb.PublishEndpoint:
        return pb.PublishEndpoint(port=self.publish_port, chunk_bytes=publish_stream.CHUNK_BYTES)

    def admit_publish(self, manifest: pb.VersionInfo) -> None:
        """Refuse a manifest before its bytes are sent (the publish checks it again when it runs)."""
        try:
            self.check_manifest(manifest)
        except Refused as err:
            raise StreamError(err.code, str(err)) from None

    def stream_publish(self, manifest: pb.VersionInfo, writer: FrameWriter, is_active: Callable[[], bool]) -> bytes:
        parts = publish_stream.received_parts(manifest, writer, is_active, publish_stream.CHUNK_BYTES)
        done = threading.Event()

        own = writer.sock.dup()  # its timeouts apart from the reading thread's

        def keepalives() -> None:  # the publisher hears the registry live while it stores (or waits to)
            with own:
                while not done.wait(publish_stream.KEEPALIVE_SECONDS):
                    try:
                        writer.keepalive(own)
                    except OSError:
                        return

        thread = threading.Thread(target=keepalives, name="publish-keepalive", daemon=True)
        thread.start()
        try:
            return self.publish_from(parts, is_active).SerializeToString()
        except Refused as err:
            raise StreamError(err.code, str(err)) from None
        finally:
            done.set()
            thread.join()  # the writer is this thread's again before the answer goes out

    # -- the weights stream -------------------------------------------------------------------------
    def stream_fetch(self, request: pb.FetchRequest, writer: FrameWriter, is_active: Callable[[], bool]) -> None:
        """A watcher's stripe over the weights stream: chunks of `chunk_size` bytes of a version (in a
        precision) from `offset`, `limit` bytes (0: to the end), each a view into the encoded messages."""
        if request.version == 0 or request.tag:
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, "the weights stream serves a version by number")
        with self._lock:
            known = request.version in self._versions or request.version in self._cache
        if not known:
            raise StreamError(grpc.StatusCode.NOT_FOUND, f"version {request.version} does not exist (or was not retained)")
        try:
            payload = self._payload(request.version)
            half = safetensors_format.half_precision(request.precision)
            if half:
                payload = payload.variant(half, is_active)
            payload.wait_verified(is_active)
        except ValueError as err:
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        except PayloadFailed as err:
            raise StreamError(err.code, str(err)) from None
        chunk = relay_chunk_bytes(payload.size)  # the size its announcement gave: no other (memory, hashes)
        if request.chunk_size != chunk:
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"chunk_size {request.chunk_size}: version {request.version} is served in the chunks of "
                              f"its announcement, {chunk} bytes")
        FETCHES.labels(request.precision or "stored").inc()
        first, last = check_range(request, chunk, payload.size, request.version)
        for index in range(first, last):
            data = payload.view(index * chunk, min((index + 1) * chunk, payload.size))
            writer.data(index, data)
            BYTES_PUSHED.inc(len(data))

    # -- fetch ------------------------------------------------------------------------------------
    def fetch_messages(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The Fetch stream as encoded WeightsChunk messages (the bytes the generated serializer would make)."""
        version = self._resolve(request.version, request.tag, context)
        precision = request.precision
        try:
            payload = self._payload(version)
            half = safetensors_format.half_precision(precision)  # ValueError for unknown names
            if half:
                payload = payload.variant(half, context.is_active)
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        FETCHES.labels(precision or "stored").inc()
        offset, size, step = request.offset, payload.size, payload.chunk_size
        end = offset + request.limit if request.limit else size
        if offset > size or end > size:
            raise Refused(grpc.StatusCode.OUT_OF_RANGE,
                  f"bytes {offset}..{end} are past the end of version {version} ({size} bytes)")
        chunk = request.chunk_size or step
        if chunk != step:
            least = -(-(end - offset) // MAX_FETCH_MESSAGES)
            if chunk < least:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"chunk_size {chunk} would cut the {end - offset} bytes into more than "
                      f"{MAX_FETCH_MESSAGES} messages: use 0 (the registry's, {step}) or at least {least}")
        with self._lock:
            info = self._info(version) if version in self._versions else payload.info
        if precision:
            info = payload.info
        sent_without_sha256 = not info.sha256
        yield wire.encode_info_chunk(info, offset)
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

    def Fetch(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightsChunk]:
        # Registered through the generated add_ModelRegistryServicer_to_server: the same stream, parsed
        # back into messages for the generated serializer. add_to_server skips this round trip.
        for message in self.fetch_messages(request, context):
            yield pb.WeightsChunk.FromString(message)

    # -- listing and tags -----------------------------------------------------------------------------
    def ListVersions(self, request: pb.ListVersionsRequest, context: grpc.ServicerContext) -> pb.ListVersionsResponse:
        with self._lock:
            return pb.ListVersionsResponse(versions=[self._info(v) for v in sorted(self._versions)])

    def SetTag(self, request: pb.SetTagRequest, context: grpc.ServicerContext) -> pb.VersionInfo:
        if request.tag in RESERVED_TAGS or not TAG_RE.match(request.tag):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                  f"tag must match {TAG_RE.pattern} and not be one of {sorted(RESERVED_TAGS)}")
        if request.remove:
            with self._lock:
                old = self._tags.pop(request.tag, None)
                if old is None:
                    raise Refused(grpc.StatusCode.NOT_FOUND, f"no version tagged {request.tag!r}")
                self._save_tags()
                if old in self._versions:
                    self.blobs.put(manifest_key(old), self._manifest_bytes(old))
                    return self._info(old)
                return pb.VersionInfo()
        version = self._resolve(request.version, "", context)
        with self._lock:
            if version not in self._versions:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"version {version} is still being published")
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
