"""The trainer's publish over the weights stream: the registry's gRPC Publish cost it 4 CPU-s per GB
received (gRPC Python's receive and TLS records), this costs it the frames' AES-GCM and one copy.

The connection is a weights stream (stream/protocol.py) the other way round, on a port of its own that
only the trainer's identity may call (authz.WEIGHTS_PUBLISH; the chart's NetworkPolicy admits only the
trainer's pods to it):

1. the handshake as a fetch's; the request is the version's manifest (a VersionInfo, its sha256 empty),
   which the registry checks before it answers with the connection's key;
2. the trainer's DATA frames, chunk `index` of `chunk_bytes` bytes each (the last one shorter), then an
   END frame holding the sha256 of them all, every frame sealed in the caller's nonce space;
3. the registry's answer, sealed in its own: keep-alives while it works, then END holding the stored
   VersionInfo, or ERROR.

A publish refused half-way is answered all the same: the registry reads on (and drops) what the trainer
still sends, so that its ERROR frame is not lost in a reset.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
import time
from collections.abc import Callable, Iterator

import grpc

from overworld.model_registry import wire
from overworld.model_registry.payload import PayloadFailed
from overworld.model_registry.stream.envelope import HANDSHAKE_SECONDS, StreamError
from overworld.model_registry.stream.protocol import (
    CALLER_SENDS,
    DATA,
    END,
    KEEPALIVE,
    SEND_SECONDS,
    SERVER_SENDS,
    FrameWriter,
    Stalled,
    WeightsStream,
    connect,
)
from overworld.v1 import model_registry_pb2 as pb

CHUNK_BYTES = 4 << 20  # every DATA frame of a publish but the last
DIGEST_BYTES = 32  # the END frame of a publish: the sha256 of its bytes
MAX_MANIFEST = 64 << 10
MAX_ANSWER = 64 << 10  # the registry's END: the stored VersionInfo
# The registry sends a keep-alive this often while a publish runs (it stores the version before it
# answers: seconds, or more on a slow object store); a publisher that hears nothing for ANSWER_STALL
# takes the registry for gone (a deleted pod's connection never closes) and tries again.
KEEPALIVE_SECONDS = 2.0
ANSWER_STALL = 15.0


class PublishFailed(grpc.RpcError):
    """A publish over the stream that failed, with the status the gRPC Publish would have ended with
    (so that callers and Retry treat both alike: UNAVAILABLE for a connection that broke)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self._code, self._details = code, message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


# -- the trainer's side ----------------------------------------------------------------------------

def publish(address: str, manifest: pb.VersionInfo, data: memoryview, chunk_bytes: int,
            timeout: float) -> pb.VersionInfo:
    """Publish `data` as `manifest` says to the registry's publish port at `address`; one attempt of at
    most `timeout` seconds. Returns the stored version's info; raises PublishFailed."""
    deadline = time.monotonic() + timeout
    try:
        sock, key = connect(address, manifest.SerializeToString(), "model-registry",
                            min(HANDSHAKE_SECONDS, timeout))
    except StreamError as err:
        raise PublishFailed(err.code, err.message) from None
    except (OSError, ssl.SSLError) as err:
        raise PublishFailed(grpc.StatusCode.UNAVAILABLE, f"the registry's publish port {address}: {err}") from None
    try:
        sent = _send(sock, key, address, data, chunk_bytes)
        left = max(deadline - time.monotonic(), 0.001)
        answer = WeightsStream(sock, key, min(ANSWER_STALL, left), left, lambda: False, deadline,
                               space=SERVER_SENDS, end_bytes=MAX_ANSWER)
        try:
            while (frame := answer.next(_no_data)).kind == KEEPALIVE:
                pass
        except (OSError, Stalled) as err:
            broke = f"sending: {sent!r}; then reading the answer: {err!r}" if sent else repr(err)
            raise PublishFailed(grpc.StatusCode.UNAVAILABLE, f"the publish to {address} broke ({broke})") from None
        if frame.kind != END:
            raise StreamError(grpc.StatusCode.INTERNAL, f"the registry answered a publish with a frame of kind {frame.kind}")
        return pb.VersionInfo.FromString(frame.body)
    except StreamError as err:
        raise PublishFailed(err.code, err.message) from None
    finally:
        sock.close()


def _send(sock: socket.socket, key: bytes, address: str, data: memoryview, chunk_bytes: int) -> OSError | None:
    """The frames of a publish: its chunks, then their sha256. A send that fails is returned, not raised:
    the registry's answer (read next) says why it stopped reading."""
    writer = FrameWriter(sock, key, address, CALLER_SENDS)
    digest = hashlib.sha256()
    try:
        for index, start in enumerate(range(0, len(data), chunk_bytes)):
            piece = data[start:start + chunk_bytes]
            digest.update(piece)  # hashlib drops the GIL: nothing else to overlap with here
            writer.data(index, piece)
        writer.end(digest.digest())
    except OSError as err:
        return err
    return None


def _no_data(index: int, length: int) -> memoryview:
    raise StreamError(grpc.StatusCode.INTERNAL, "the registry answered a publish with data")


# -- the registry's side ---------------------------------------------------------------------------

def received_parts(manifest: pb.VersionInfo, writer: FrameWriter, is_active: Callable[[], bool],
                   chunk_bytes: int) -> Iterator[wire.PublishPart]:
    """A publish's frames as the parts of a gRPC Publish (model_registry/publish.py reads either): the
    manifest, each chunk (a buffer of its own, which the payload keeps a view of), then the sha256.
    Raises PayloadFailed for frames out of order or beyond the declared size, and for a stream that broke."""
    reader = WeightsStream(writer.sock, writer.key, SEND_SECONDS, SEND_SECONDS, lambda: not is_active(),
                           space=CALLER_SENDS, end_bytes=DIGEST_BYTES)
    yield wire.PublishPart(manifest=manifest)
    index = received = 0
    chunk = memoryview(b"")

    def into(at: int, length: int) -> memoryview:
        nonlocal chunk
        if at != index or length > chunk_bytes or received + length > manifest.size_bytes:
            raise PayloadFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                f"chunk {at} of {length} bytes: expected chunk {index} of at most {chunk_bytes} "
                                f"bytes, {manifest.size_bytes - received} of the declared size_bytes left")
        chunk = memoryview(bytearray(length))
        return chunk

    while True:
        try:
            frame = reader.next(into)
        except StreamError as err:  # an altered frame: DATA_LOSS
            raise PayloadFailed(err.code, f"the publish stream: {err.message}") from None
        except (OSError, Stalled) as err:
            raise PayloadFailed(grpc.StatusCode.ABORTED, f"the publish stream broke: {err!r}") from None
        if frame.kind == DATA:
            yield wire.PublishPart(chunk=chunk)
            index, received = index + 1, received + frame.length
        elif frame.kind == END:
            if len(frame.body) != DIGEST_BYTES:
                raise PayloadFailed(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"a publish ends with the {DIGEST_BYTES}-byte sha256 of its bytes, not "
                                    f"{len(frame.body)} bytes")
            yield wire.PublishPart(sha256=frame.body.hex())
            return
        elif frame.kind != KEEPALIVE:
            raise PayloadFailed(grpc.StatusCode.INVALID_ARGUMENT, f"a frame of kind {frame.kind} in a publish")

