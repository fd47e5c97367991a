"""The weights stream: how a version's chunks travel from the registry to a worker and from one worker
to the next (the relay), outside gRPC Python.

Why not gRPC: gRPC Python costs a receiver 2.4 CPU-s per GB before TLS, and Python's `ssl` reads TLS
records of 16 KB with two system calls each (1.2 CPU-s per GB received here); the relay's budget is
2 CPU-s per GB for receiving, checking, passing on and swapping in a version. So a connection is:

1. TCP, then a TLS 1.3 handshake with the run's certificates, both ways (core/security/tls.py's files: the
   server asks for a client certificate of the run's CA, the client checks the server's against the
   CA and the name of the identity it means to reach, as gRPC does: the registry's, or a relaying
   worker's). The server reads the caller's identity from its certificate and
   checks it against core/security/authz.py's table, as the gRPC interceptor does.
2. Inside TLS: the request (a FetchRequest, protobuf), the answer (a status; when OK a fresh AES-128
   key for this connection), and the client's "start". Nothing else goes through TLS.
3. On the bare socket: frames of a 9-byte header (kind, chunk index, length) and a payload sealed with
   AES-128-GCM under that key (the header is its associated data, the nonce a frame counter, so a
   frame cannot be altered, replayed, reordered or dropped unnoticed; the first byte of the nonce says
   which side sealed it, so a frame cannot be reflected back either), 512 KB and more each: a chunk
   is read with recv_into into a reused buffer and opened into the version's own buffer, and one is
   sealed from a slice of that buffer and sent with sendmsg. AES-GCM of `cryptography` costs 0.1
   CPU-s per GB each way here (docs/model_registry.md has the measurements).

Without credentials (`--insecure`, tests) the same exchange runs in plaintext, frames unsealed.
A frame's payload is what its kind says: DATA a chunk of the version; KEEPALIVE nothing (the sender
lives but has no data yet); END nothing (the stream ended complete; a publish's END holds the version's
sha256, and the registry's answer to it the stored VersionInfo); ERROR a status code and a message.

The trainer publishes the same way, the other way round (stream/publish.py): its request is the
version's manifest, and the DATA frames go from it to the registry, sealed in the caller's nonce space.
"""

from __future__ import annotations

import logging
import socket
import ssl
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from overworld.core.security import tls
from overworld.core.security.peers import WrongPeer, presented_identity
from overworld.model_registry.stream.envelope import (
    HANDSHAKE_SECONDS,
    Envelope,
    StreamError,
    answer,
    contexts,
)
from overworld.v1 import model_registry_pb2 as pb

log = logging.getLogger("overworld.model_registry.stream.protocol")

HEADER = struct.Struct("!BII")  # kind, chunk index, payload length
DATA, KEEPALIVE, END, ERROR = 1, 2, 3, 4
TAG = 16  # AES-GCM's tag after every sealed payload
KEY_BYTES = 16
MAX_REQUEST = 4096  # a FetchRequest is tens of bytes
MAX_FRAME = 64 << 20  # the largest chunk (relay.MAX_CHUNK)
MAX_ERROR = 2048
SEND_SECONDS = 60.0  # a receiver that takes nothing for this long is dropped (a stopped pod)
# The least rate of data a frame is sent and received at, once it is under way (bytes/s): a frame of n
# bytes has SEND_SECONDS + n / MIN_RATE seconds in all, whatever the socket's timeouts (a reader taking a
# byte a minute, or a relay dripping a chunk now and then, is cut off and, a relay, reported).
MIN_RATE = 1 << 20
POLL_SECONDS = 0.25  # how often a receiver blocked on its socket looks at its stop and stall clocks
MAX_CONNECTIONS = 512
MAX_CONNECTIONS_PER_PEER = 16  # one host's open connections (a worker holds one per stripe it fetches)
START = b"S"
SERVER_SENDS, CALLER_SENDS = 0, 1  # the nonce spaces: the first byte of every nonce
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class Altered(StreamError):
    """A frame that did not open here (its tag did not match): changed on the way, or by the sender."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.DATA_LOSS, "a frame was altered on the way")


class Stalled(Exception):
    """No frame at all for the stall time, or no data for the data stall time."""


# -- frames ------------------------------------------------------------------------------------------

def _nonce(space: int, counter: int) -> bytes:
    return bytes((space,)) + counter.to_bytes(11, "big")


def send_parts(sock: socket.socket, parts: list[memoryview], deadline: float | None = None) -> None:
    """Send every byte of `parts` with as few system calls as the socket takes (no joined copy), all of
    them by `deadline` (monotonic; TimeoutError after it, however the receiver takes them)."""
    views = [p for p in parts if len(p)]
    total = sum(len(v) for v in views)
    while views:
        try:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
            sent = sock.sendmsg(views)
        except TimeoutError:
            raise TimeoutError(f"the receiver took a frame of {total} bytes too slowly ({total - sum(len(v) for v in views)}"
                               " sent by its deadline)") from None
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


# In place (no copy of a frame) where cryptography has it (46+). MineStudio's environment holds
# cryptography below 46 (gym3 needs cffi<2): there a frame is sealed and opened through one more copy,
# the same bytes on the wire.
IN_PLACE = hasattr(AESGCM, "encrypt_into") and hasattr(AESGCM, "decrypt_into")


class FrameWriter:
    """The server's side of a stream once it started: sealed frames, one reused output buffer."""

    def __init__(self, sock: socket.socket, key: bytes, peer: str, space: int = SERVER_SENDS) -> None:
        """`space`: the nonce space of the side that writes (SERVER_SENDS, or CALLER_SENDS for a publish)."""
        self.sock = sock
        self.peer = peer
        self.key = key
        self.space = space
        self._aead = AESGCM(key) if key else None
        self._out = bytearray()
        self._counter = 0
        self.sent = 0  # data bytes sent

    def data(self, index: int, chunk: memoryview) -> None:
        self._send(DATA, index, chunk)
        self.sent += len(chunk)

    def keepalive(self, sock: socket.socket | None = None) -> None:
        """`sock`: another socket object of the same connection (`sock.dup()`), for a thread that sends
        keep-alives while this one reads: a socket object's timeout is its own."""
        self._send(KEEPALIVE, 0, memoryview(b""), sock)

    def end(self, body: bytes = b"") -> None:
        self._send(END, 0, memoryview(body))

    def error(self, code: grpc.StatusCode, message: str) -> None:
        self._send(ERROR, 0, memoryview(answer(code, message.encode()[:MAX_ERROR - 1])))

    def _send(self, kind: int, index: int, payload: memoryview, sock: socket.socket | None = None) -> None:
        sock = sock or self.sock
        header = HEADER.pack(kind, index, len(payload))
        deadline = time.monotonic() + SEND_SECONDS + len(payload) / MIN_RATE  # a slow reader is cut off
        if self._aead is None:
            send_parts(sock, [memoryview(header), payload], deadline)
            return
        need = len(payload) + TAG
        if len(self._out) < need:
            self._out = bytearray(need)
        sealed = memoryview(self._out)[:need]
        if IN_PLACE:
            self._aead.encrypt_into(_nonce(self.space, self._counter), payload, header, sealed)
        else:
            sealed[:] = self._aead.encrypt(_nonce(self.space, self._counter), payload, header)
        self._counter += 1
        send_parts(sock, [memoryview(header), sealed], deadline)


@dataclass
class Frame:
    kind: int
    index: int
    length: int
    body: bytes = b""  # an END frame's


class WeightsStream:
    """The client's side: frames read into where `into(index, length)` says (the version's buffer),
    opened there; a reused buffer for what arrives sealed. Raises Stalled when nothing at all arrives
    for `stall` seconds, no DATA frame for `data_stall` seconds, or a DATA frame's bytes take longer than
    `data_stall` and their length at MIN_RATE (a relay that drips them), StreamError for an ERROR frame or a
    frame that does not open (DATA_LOSS: altered on the way)."""

    def __init__(self, sock: socket.socket, key: bytes, stall: float, data_stall: float,
                 stop: Callable[[], bool], deadline: float | None = None, space: int = SERVER_SENDS,
                 end_bytes: int = 0) -> None:
        """`deadline` (monotonic): the fetch's; a frame under way when it passes ends the stream (Stalled),
        however steadily its bytes drip. `space`: the nonce space of the side that writes; `end_bytes`:
        the most an END frame may hold."""
        self.deadline = deadline
        self.space, self.end_bytes = space, end_bytes
        self.sock = sock
        self._aead = AESGCM(key) if key else None
        self._counter = 0
        self._sealed = bytearray()
        self._header = bytearray(HEADER.size)
        self.stall, self.data_stall, self.stop = stall, data_stall, stop
        self.last_byte = self.last_data = time.monotonic()
        self._frame_deadline: float | None = None  # the DATA frame under way: data_stall + its bytes / MIN_RATE
        sock.settimeout(min(POLL_SECONDS, stall))

    def _fill(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                n = -1
            now = time.monotonic()
            if n == 0:
                raise ConnectionError("the source closed the connection")
            if n > 0:
                got += n
                self.last_byte = now
            if self.stop():
                raise ConnectionAbortedError("stopped")
            if now - self.last_byte > self.stall:
                raise Stalled(f"nothing for {self.stall:.0f} s")
            if self._frame_deadline is None and now - self.last_data > self.data_stall:
                raise Stalled(f"no data for {self.data_stall:.0f} s (keep-alives only)")
            if self._frame_deadline is not None and now > self._frame_deadline:  # its bytes come, but too slowly
                raise Stalled(f"a chunk arrived under the minimum rate ({MIN_RATE >> 10} KiB/s)")
            if self.deadline is not None and now > self.deadline:
                raise Stalled("the fetch's deadline passed with a frame under way")

    def next(self, into: Callable[[int, int], memoryview]) -> Frame:
        header = memoryview(self._header)
        self._fill(header)
        kind, index, length = HEADER.unpack(header)
        if kind not in (DATA, KEEPALIVE, END, ERROR) or length > MAX_FRAME or (kind == KEEPALIVE and length) or (
                kind == END and length > self.end_bytes) or (kind == ERROR and not 1 <= length <= MAX_ERROR):
            raise StreamError(grpc.StatusCode.INTERNAL, f"a frame of kind {kind} and {length} bytes")
        if kind == DATA:
            dest = into(index, length)  # ValueError: a chunk that was not asked for
            self._frame_deadline = time.monotonic() + self.data_stall + length / MIN_RATE
            try:
                self._open(bytes(header), dest)
            finally:
                self._frame_deadline = None
            self.last_data = time.monotonic()
        elif kind == ERROR:
            message = bytearray(length)
            self._open(bytes(header), memoryview(message))
            code = _CODES.get(message[0], grpc.StatusCode.UNKNOWN)
            raise StreamError(code, message[1:].decode(errors="replace"))
        else:
            body = bytearray(length)
            self._open(bytes(header), memoryview(body))
            return Frame(kind, index, length, bytes(body))
        return Frame(kind, index, length)

    def _open(self, header: bytes, dest: memoryview) -> None:
        if self._aead is None:
            self._fill(dest)
            return
        need = len(dest) + TAG
        if len(self._sealed) < need:
            self._sealed = bytearray(need)
        sealed = memoryview(self._sealed)[:need]
        self._fill(sealed)
        try:
            if IN_PLACE:
                self._aead.decrypt_into(_nonce(self.space, self._counter), sealed, header, dest)
            else:
                dest[:] = self._aead.decrypt(_nonce(self.space, self._counter), sealed, header)
        except InvalidTag:
            raise Altered() from None
        self._counter += 1

    def close(self) -> None:
        self.sock.close()


HOSTNAME_MISMATCH = 62  # X509_V_ERR_HOSTNAME_MISMATCH: the certificate is of the run, but not of the peer meant


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def connect(address: str, request: bytes, peer: str, connect_timeout: float = HANDSHAKE_SECONDS
            ) -> tuple[socket.socket, bytes]:
    """Connect to a weights stream at `address`, served by `peer` (the registry, "model-registry", or a
    relaying worker, "rollout-worker"), send `request` (a serialized FetchRequest, or a publish's
    VersionInfo), and return the socket with the connection's key once the server said OK and the frames
    may begin. Raises OSError (nobody answers), ssl.SSLError (the handshake failed), StreamError (its
    answer; UNAUTHENTICATED: the server presented another identity's certificate)."""
    host, port = split_address(address)
    sock = socket.create_connection((host, port), timeout=connect_timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        files = tls.credentials()
        made = contexts.get(files, server=False)
        try:
            envelope = Envelope(sock, made[0] if made else None, server=False, peer=peer)
        except ssl.SSLCertVerificationError as err:
            if files is None or err.verify_code != HOSTNAME_MISMATCH:
                raise
            raise StreamError(grpc.StatusCode.UNAUTHENTICATED,
                              WrongPeer(address, peer, presented_identity(address, files.directory)).details()) from None
        envelope.send(request)
        answer = envelope.receive(MAX_ERROR + KEY_BYTES)
        if not answer:
            raise StreamError(grpc.StatusCode.INTERNAL, "an empty answer")
        code = _CODES.get(answer[0], grpc.StatusCode.UNKNOWN)
        if code != grpc.StatusCode.OK:
            raise StreamError(code, answer[1:].decode(errors="replace"))
        key = answer[1:]
        if len(key) != (KEY_BYTES if made else 0):
            raise StreamError(grpc.StatusCode.INTERNAL, f"a key of {len(key)} bytes")
        envelope.send(START)
        envelope.finish()
        return sock, key
    except BaseException:
        sock.close()
        raise


def open_stream(address: str, request: pb.FetchRequest, stall: float, data_stall: float,
                stop: Callable[[], bool], peer: str, connect_timeout: float = HANDSHAKE_SECONDS,
                deadline: float | None = None) -> WeightsStream:
    """Ask the weights stream at `address` (served by `peer`) for `request` and return the frames'
    reader; raises as `connect`."""
    sock, key = connect(address, request.SerializeToString(), peer, connect_timeout)
    return WeightsStream(sock, key, stall, data_stall, stop, deadline)
