"""Thin client of the model-registry: publish, fetch (resumable, optionally in half precision; as
bytes or as a state dict), list, tags, watch, acknowledgements and push status."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable, Iterator

import grpc

from overworld.core.client import ServiceClient
from overworld.core.grpc_util import Retry
from overworld.core.wire import safetensors_format
from overworld.model_registry import wire
from overworld.model_registry.stream import publish as publish_stream
from overworld.v1 import model_registry_pb2 as pb
from overworld.v1 import model_registry_pb2_grpc

CHUNK = 4 << 20  # the registry's message size: each chunk published becomes one message sent
WATCH_SECONDS = 3600.0  # a watch stream's deadline; the watcher then opens the next one
_SERVICE = "/overworld.v1.ModelRegistry/"
log = logging.getLogger("overworld.model_registry.client")


def _identity(message: bytes) -> bytes:
    return message


class FetchBroken(Exception):
    """A fetch that cannot complete: the version went away or its publish failed."""


class ModelRegistryClient(ServiceClient):
    def __init__(self, address: str, *, channel: grpc.Channel | None = None) -> None:
        super().__init__(address, model_registry_pb2_grpc.ModelRegistryStub, "model-registry", channel=channel)
        self._acks: set[grpc.Future] = set()
        self._acks_lock = threading.Lock()
        # A channel made otherwise (a port-forward's) reaches the gRPC port alone: publish over gRPC then
        self._endpoint: pb.PublishEndpoint | None = None if channel is None else pb.PublishEndpoint()
        # Publish and Fetch through hand-encoded messages (same bytes on the wire): one copy per chunk
        self._publish = self._channel.stream_unary(
            _SERVICE + "Publish", request_serializer=_identity, response_deserializer=pb.VersionInfo.FromString,
            _registered_method=True)  # type: ignore[call-arg]  # grpc's own keyword; types-grpcio lacks it
        self._fetch = self._channel.unary_stream(
            _SERVICE + "Fetch", request_serializer=pb.FetchRequest.SerializeToString,
            response_deserializer=wire.decode_chunk, _registered_method=True)  # type: ignore[call-arg]  # grpc keyword, as above

    # -- publish -------------------------------------------------------------------------------
    def publish(self, version: int, data: bytes | bytearray | memoryview, parent: int = 0,
                counters: dict[str, int] | None = None, config_hash: str = "", tags: list[str] | None = None,
                dtype: str = "", chunk_size: int = CHUNK, *, timeout: float = 300.0) -> pb.VersionInfo:
        """Publish `data` (safetensors bytes) as `version`: over the weights stream to the registry's
        publish port when it has one, else by gRPC Publish (`_publish_endpoint` says when). Retried
        (publishing the same bytes again is idempotent). `dtype` defaults to the payload's floating dtype.
        `chunk_size`: the gRPC Publish's messages; over the stream the registry's frame size is used."""
        view = memoryview(data)
        manifest = pb.VersionInfo(version=version, parent=parent, size_bytes=len(view),
                                  dtype=dtype or safetensors_format.payload_dtype(view), counters=counters or {},
                                  config_hash=config_hash, tags=tags or [])

        def messages() -> Iterator[bytes]:
            yield wire.encode_publish_manifest(manifest)
            digest = hashlib.sha256()  # hashed while gRPC sends the chunk before (hashlib drops the GIL)
            for i in range(0, len(view), chunk_size):
                chunk = view[i:i + chunk_size]
                digest.update(chunk)
                yield wire.encode_publish_chunk(chunk)
            yield wire.encode_publish_sha256(digest.hexdigest())

        def attempt(left: float) -> pb.VersionInfo:
            endpoint = self._publish_endpoint(left)
            if not endpoint.port:
                return self._publish(messages(), timeout=left)
            try:
                return publish_stream.publish(f"{self.address.rpartition(':')[0]}:{endpoint.port}", manifest, view,
                                              endpoint.chunk_bytes or CHUNK, left)
            except publish_stream.PublishFailed as err:
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    self._endpoint = None  # a restarted registry may listen elsewhere: ask again
                raise

        return Retry(timeout).run(attempt, "registry.Publish")

    def _publish_endpoint(self, timeout: float) -> pb.PublishEndpoint:
        """Where this registry takes a publish over the weights stream (asked once, and again after a
        connection to it failed); port 0: over gRPC (a registry from before the publish port, or a client
        on a channel of its own, such as a port-forward's, which carries the gRPC port alone)."""
        if self._endpoint is None:
            try:
                self._endpoint = Retry(timeout).unary(self._stub.GetPublishEndpoint, pb.PublishEndpointRequest(),
                                                      "registry.GetPublishEndpoint")
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.warning("the registry at %s has no publish port (an older release): publishing over gRPC, "
                            "which costs it about twice the CPU", self.address)
                self._endpoint = pb.PublishEndpoint()
        return self._endpoint

    # -- fetch ---------------------------------------------------------------------------------
    def _fetch_stream(self, version: int, tag: str, precision: str, verify: bool, timeout: float,
                      stop: Callable[[], bool] | None, sink: Callable[[pb.VersionInfo, int, memoryview], None]
                      ) -> pb.VersionInfo:
        """Run a Fetch, resuming from the last byte received when the stream breaks; every piece of
        data goes to sink(info, offset, data). Checks offsets, the size and (verify) the sha256."""
        info: pb.VersionInfo | None = None
        received = 0
        digest = hashlib.sha256() if verify else None

        def attempt(left: float) -> None:
            nonlocal info, received
            request = pb.FetchRequest(version=info.version if info else version, tag="" if info else tag,
                                      offset=received, precision=precision)
            stream = self._fetch(request, timeout=left)
            for chunk in stream:
                if chunk.info is not None:
                    # a version still being published comes without its sha256, then ends with the whole info
                    if info is None or not info.sha256:
                        info = chunk.info
                    elif chunk.info.sha256 and chunk.info.sha256 != info.sha256:
                        raise FetchBroken(f"version {info.version} changed while fetching")
                n = len(chunk.data)
                if not n:
                    continue
                if info is None:
                    raise FetchBroken("the registry sent bytes before the version's info")
                if chunk.offset != received:
                    raise FetchBroken(f"registry sent offset {chunk.offset}, expected {received}")
                if received + n > info.size_bytes:
                    raise FetchBroken(f"registry sent more than the {info.size_bytes} bytes of the version")
                sink(info, received, chunk.data)
                if digest is not None:
                    digest.update(chunk.data)
                received += n
                if stop is not None and stop():
                    stream.cancel()
                    raise FetchBroken("stopped")

        Retry(timeout).run(attempt, "registry.Fetch", stop=stop)  # each attempt resumes where the last broke
        if info is None:
            raise FetchBroken("the registry ended the fetch without sending the version")
        if received != info.size_bytes:
            raise FetchBroken(f"received {received} of {info.size_bytes} bytes of version {info.version}")
        if digest is not None and digest.hexdigest() != info.sha256:
            raise FetchBroken(f"fetched version {info.version} does not match its sha256")
        return info

    def fetch(self, version: int = 0, tag: str = "", *, precision: str = "", verify: bool = True,
              stop: Callable[[], bool] | None = None, timeout: float = 300.0) -> tuple[pb.VersionInfo, bytes]:
        """A whole version (0: the latest; or the one `tag` names) as bytes, resuming where the stream
        broke (retried). Returns the info of the bytes received (with `precision`, of the converted
        payload). `stop`, asked after every message, gives up (FetchBroken).

        Raises grpc.RpcError from the registry (NOT_FOUND: no such version; DATA_LOSS / ABORTED: its
        publish failed; UNAVAILABLE: unreachable for `timeout`), FetchBroken when what arrived is
        inconsistent (size, offsets, sha256 when `verify`)."""
        pieces: list[memoryview] = []
        info = self._fetch_stream(version, tag, precision, verify, timeout, stop,
                                  lambda info, offset, data: pieces.append(data))
        return info, b"".join(pieces)

    def fetch_state(self, version: int = 0, tag: str = "", *, like: dict | None = None, precision: str = "",
                    verify: bool = True, stop: Callable[[], bool] | None = None,
                    timeout: float = 300.0) -> tuple[pb.VersionInfo, dict]:
        """A version as a state dict, fetched as `fetch` does. The registry cuts its messages at tensor
        boundaries, so a tensor is a view into the message it arrived in (no copy; treat it as
        read-only); tensors are cast to like's dtypes where they differ."""
        from overworld.core.wire import weights  # torch: the learners' and workers' side only

        pieces: list[tuple[int, memoryview]] = []
        info = self._fetch_stream(version, tag, precision, verify, timeout, stop,
                                  lambda info, offset, data: pieces.append((offset, data)))
        return info, weights.from_pieces(pieces, like)

    # -- the rest --------------------------------------------------------------------------------
    def list_versions(self, *, timeout: float = 30.0) -> list[pb.VersionInfo]:
        """The versions held, oldest first. Retried."""
        return list(Retry(timeout).unary(self._stub.ListVersions, pb.ListVersionsRequest(), "registry.ListVersions")
                    .versions)

    def set_tag(self, tag: str, version: int = 0, *, timeout: float = 30.0) -> pb.VersionInfo:
        """Tag `version` (0: the latest). Retried (idempotent)."""
        return Retry(timeout).unary(self._stub.SetTag, pb.SetTagRequest(tag=tag, version=version), "registry.SetTag")

    def remove_tag(self, tag: str, *, timeout: float = 30.0) -> pb.VersionInfo:
        """Remove `tag`. Retried (idempotent)."""
        return Retry(timeout).unary(self._stub.SetTag, pb.SetTagRequest(tag=tag, remove=True), "registry.SetTag")

    def watch(self, watcher_id: str, known_version: int = 0, relay_port: int = 0, precision: str = "",
              relay_host: str = "", *, timeout: float = WATCH_SECONDS) -> Iterator[pb.Announcement]:
        """The Watch stream of announcements (cancel it with .cancel()); one attempt. It ends with
        DEADLINE_EXCEEDED after `timeout` seconds, like every call: open the next one with the version held
        (the registry announces its latest version at once when it differs from `known_version`).
        `relay_port`: this watcher relays what it receives (the RolloutWorker service on that port, at
        `relay_host`, or the address the registry sees it at), in `precision`."""
        return self._stub.WatchAnnouncements(pb.WatchRequest(watcher_id=watcher_id, known_version=known_version,
                                                             relay_port=relay_port, precision=precision,
                                                             relay_host=relay_host), timeout=timeout)

    def ack(self, watcher_id: str, version: int, relay_faults: list[pb.RelayFault] | None = None, *,
            timeout: float = 5.0) -> grpc.Future:
        """Acknowledge a swapped-in version without waiting for the reply (with the relays that failed
        this watcher since the last one); one attempt (the next version's ack says as much)."""
        future = self._stub.AckVersion.future(pb.AckVersionRequest(watcher_id=watcher_id, version=version,
                                                                   relay_faults=relay_faults or []),
                                              timeout=timeout)
        # a call future that is garbage-collected before it completes cancels its RPC: hold it until then
        with self._acks_lock:
            self._acks.add(future)
        future.add_done_callback(self._ack_done)
        return future

    def _ack_done(self, future: grpc.Future) -> None:
        with self._acks_lock:
            self._acks.discard(future)

    def push_status(self, version: int = 0, *, wait: float = 0.0, timeout: float = 30.0) -> pb.PushStatus:
        """How the push of `version` (0: the latest) to the watchers goes; the registry holds the call up
        to `wait` seconds for the push to complete, and the answer may take `timeout` beyond that. One
        attempt (its callers poll)."""
        return self._stub.GetPushStatus(pb.PushStatusRequest(version=version, wait_seconds=wait),
                                        timeout=wait + timeout)
