"""The handshake part of a weights-stream connection (stream/protocol.py describes the whole): TLS 1.3
with the run's certificates, both ways, through memory BIOs, and the few messages sent inside it."""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import grpc

from overworld.core.security import authz, tls

RECORD_HEADER = 5  # a TLS record: type, version (2 bytes), length (2 bytes), then that many bytes
MAX_RECORD = (1 << 14) + 256  # TLS 1.3's largest ciphertext record
HANDSHAKE_SECONDS = 10.0  # TLS, request, answer and start, all of it: a peer slower than this is dropped


class StreamError(Exception):
    """The other side answered with a status (or broke the protocol: INTERNAL / DATA_LOSS)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class Contexts:
    """SSL contexts of one identity's credential files, made again when the files change (rotation)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[tuple[Path, bool], tuple[tuple[bytes, bytes, bytes], ssl.SSLContext, str]] = {}

    def get(self, files: tls.CredentialFiles | None, server: bool) -> tuple[ssl.SSLContext, str] | None:
        """(context, the run its certificate names) or None for plaintext."""
        if files is None:
            return None
        files.reload()
        key = (files.directory, server)
        with self._lock:
            made = self._made.get(key)
            if made is None or made[0] != files.pems:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
                ctx.minimum_version = ssl.TLSVersion.TLSv1_3
                ctx.load_cert_chain(files.directory / tls.CERT, files.directory / tls.KEY)
                ctx.load_verify_locations(files.directory / tls.CA)
                ctx.verify_mode = ssl.CERT_REQUIRED
                if server:
                    ctx.num_tickets = 0  # no session tickets: the TLS part of a connection ends where the frames begin
                made = self._made[key] = (files.pems, ctx, files.run())
            return made[1], made[2]


contexts = Contexts()


class Envelope:
    """The handshake part of a connection: TLS through memory BIOs (so that this code, not OpenSSL,
    reads the socket and no byte of the frames after it is taken), or plaintext."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext | None, server: bool, peer: str = "",
                 deadline: float | None = None) -> None:
        """`peer`: a client's, the identity whose certificate the server must present. `deadline`
        (monotonic): when the whole exchange, handshake to start, must be over (HANDSHAKE_SECONDS from
        now if None): each read waits only what is left, so a peer sending a byte now and then is cut
        off all the same."""
        self.sock = sock
        self.deadline = time.monotonic() + HANDSHAKE_SECONDS if deadline is None else deadline
        self.obj: ssl.SSLObject | None = None
        if ctx is not None:
            self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
            self.obj = ctx.wrap_bio(self._in, self._out, server_side=server,
                                    server_hostname=None if server else tls.server_name(peer))
            while True:
                try:
                    self.obj.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    self._flush()
                    self._pump()
            self._flush()

    def _flush(self) -> None:
        assert self.obj is not None
        data = self._out.read()
        if data:
            self.sock.sendall(data)

    def _wait(self) -> None:
        """Before a read: the socket waits only what is left of the exchange's time."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the handshake and request took more than {HANDSHAKE_SECONDS:g} s in all")
        self.sock.settimeout(left)

    def _pump(self) -> None:
        """One TLS record from the socket into TLS, read exactly: the bytes after the handshake's last
        record (a publisher's first frames, sent with its "start") stay on the socket."""
        header = self._exactly(RECORD_HEADER)
        length = int.from_bytes(header[3:5], "big")
        if length > MAX_RECORD:
            raise StreamError(grpc.StatusCode.INTERNAL, f"a TLS record of {length} bytes")
        self._in.write(header + self._exactly(length))

    def _exactly(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            self._wait()
            data = self.sock.recv(n - len(out))
            if not data:
                raise ConnectionError("the peer closed the connection")
            out += data
        return bytes(out)

    def peer(self) -> tuple[str, str]:
        """(run, identity) from the peer's certificate; ("", "") in plaintext."""
        if self.obj is None:
            return "", ""
        return authz.certificate_identity(self.obj.getpeercert() or {})

    def send(self, data: bytes) -> None:
        message = struct.pack("!I", len(data)) + data
        if self.obj is None:
            self.sock.sendall(message)
            return
        self.obj.write(message)
        self._flush()

    def _read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            if self.obj is None:
                self._wait()
                part = self.sock.recv(n - len(out))
                if not part:
                    raise ConnectionError("the peer closed the connection")
            else:
                try:
                    part = self.obj.read(n - len(out))
                except ssl.SSLWantReadError:
                    self._pump()
                    continue
                if not part:
                    raise ConnectionError("the peer closed the connection")
            out += part
        return bytes(out)

    def receive(self, limit: int) -> bytes:
        (n,) = struct.unpack("!I", self._read(4))
        if n > limit:
            raise StreamError(grpc.StatusCode.INVALID_ARGUMENT, f"a message of {n} bytes (at most {limit})")
        return self._read(n)

    def finish(self) -> None:
        """The frames begin: nothing of them may have been read into TLS's buffer."""
        if self.obj is not None and self._in.pending:
            raise StreamError(grpc.StatusCode.INTERNAL, "the peer sent more than the protocol's handshake")


def answer(code: grpc.StatusCode, body: bytes) -> bytes:
    return struct.pack("!B", code.value[0]) + body


