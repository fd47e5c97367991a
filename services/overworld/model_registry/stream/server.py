"""The serving side of the weights stream (stream.py describes the protocol): a TCP port, a thread per
connection, each caller checked against core/security/authz.py's table before the handler sends its frames."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from overworld.core.security import authz, tls
from overworld.model_registry.stream.envelope import (
    HANDSHAKE_SECONDS,
    Envelope,
    StreamError,
    answer,
    contexts,
)
from overworld.model_registry.stream.protocol import (
    KEY_BYTES,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_PEER,
    MAX_REQUEST,
    SEND_SECONDS,
    START,
    FrameWriter,
)
from overworld.v1 import model_registry_pb2 as pb

log = logging.getLogger("overworld.model_registry.stream.protocol")

# (request, writer, still wanted) -> what the END frame holds (None: nothing)
Handler = Callable[[Any, FrameWriter, Callable[[], bool]], bytes | None]


def _drain(conn: socket.socket, limit: int = MAX_REQUEST + 4096, seconds: float = 1.0) -> None:
    """After a refusal sent before the caller's request was read: end the sending side and read what the
    caller sends meanwhile (unread, it would make the close a reset that can destroy the refusal on its
    way), for at most `seconds` and `limit` bytes."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        deadline, read = time.monotonic() + seconds, 0
        while read < limit and (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            data = conn.recv(1 << 16)
            if not data:
                return
            read += len(data)


class WeightsStreamServer:
    """Serves one weights-stream endpoint (`method`: authz.WEIGHTS_FROM_REGISTRY, _RELAY or _PUBLISH) on
    a TCP port: a thread per connection, each checked against core/security/authz.py's table before its
    request is read. The request is a `request_type` of at most `max_request` bytes; `admit(request)`
    may refuse it (StreamError) before the frames begin. The handler sends frames through the writer (a
    publish's reads them from its socket) and raises StreamError to end with a status; its third argument
    says whether the connection is still wanted (False once the server stops). With `drain_on_error`
    (a publish, whose caller is sending), what the caller still sends after an ERROR is read and dropped,
    so that the ERROR reaches it instead of a reset."""

    def __init__(self, method: str, handler: Handler, host: str = "127.0.0.1", port: int = 0, *,
                 request_type: Any = pb.FetchRequest, max_request: int = MAX_REQUEST,
                 admit: Callable[[Any], None] | None = None, drain_on_error: bool = False) -> None:
        self.method, self.handler = method, handler
        self.request_type, self.max_request, self.admit = request_type, max_request, admit
        self.drain_on_error = drain_on_error
        self._files = tls.credentials()  # this process's identity when the server starts, as a gRPC server's
        self._listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                              backlog=256)
        self.port: int = self._listener.getsockname()[1]
        self._open: set[socket.socket] = set()
        self._per_peer: dict[str, int] = {}  # open connections by peer host
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"weights-stream-{self.port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, address = self._listener.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                time.sleep(0.05)  # out of file descriptors, say: do not spin
                continue
            host = address[0]
            with self._lock:  # a flood from one host (slow or not) takes its own slots, not everyone's
                if len(self._open) >= MAX_CONNECTIONS or self._per_peer.get(host, 0) >= MAX_CONNECTIONS_PER_PEER:
                    log.warning("weights stream: refused a connection from %s (%d open from it, %d in all)", host,
                                self._per_peer.get(host, 0), len(self._open))
                    conn.close()
                    continue
                self._open.add(conn)
                self._per_peer[host] = self._per_peer.get(host, 0) + 1
            threading.Thread(target=self._serve, args=(conn, host), name="weights-stream-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, host: str) -> None:
        peer = host
        try:
            name = conn.getpeername()
            peer = f"{name[0]}:{name[1]}"
            conn.settimeout(HANDSHAKE_SECONDS)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            made = contexts.get(self._files, server=True)
            envelope = Envelope(conn, made[0] if made else None, server=True)
            if made is not None:  # the caller first, straight after the handshake: a stranger's bytes go unread
                run, identity = envelope.peer()
                refused = authz.refusal(made[1], run, identity, self.method)
                if refused:
                    log.warning("weights stream: refused %s: %s", peer, refused)
                    envelope.send(answer(grpc.StatusCode.PERMISSION_DENIED, refused.encode()))
                    _drain(conn)
                    return
            try:
                request = self.request_type.FromString(envelope.receive(self.max_request))
                if self.admit is not None:
                    self.admit(request)
            except StreamError as err:
                envelope.send(answer(err.code, err.message.encode()))
                return
            except DecodeError:
                envelope.send(answer(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"the request is not a {self.request_type.DESCRIPTOR.name}".encode()))
                return
            key = os.urandom(KEY_BYTES) if made is not None else b""
            envelope.send(answer(grpc.StatusCode.OK, key))
            if envelope.receive(len(START)) != START:
                return
            envelope.finish()
            conn.settimeout(SEND_SECONDS)
            writer = FrameWriter(conn, key, peer)
            try:
                body = self.handler(request, writer, lambda: not self._stopped.is_set())
            except StreamError as err:
                writer.error(err.code, err.message)
                if self.drain_on_error:
                    _drain(conn, limit=1 << 40, seconds=SEND_SECONDS)
                return
            writer.end(body or b"")
        except TimeoutError as err:  # the whole exchange's deadline, or a frame's: cut off
            log.warning("weights stream to %s cut off: %s", peer, err)
        except (OSError, ssl.SSLError, StreamError) as err:
            log.debug("weights stream to %s ended: %r", peer, err)
        except Exception:  # a bug: said, and this connection closed; the server goes on
            log.exception("weights stream to %s failed", peer)
        finally:
            with self._lock:
                self._open.discard(conn)
                self._per_peer[host] -= 1
                if not self._per_peer[host]:
                    del self._per_peer[host]
            conn.close()

    def stop(self) -> None:
        self._stopped.set()
        self._listener.close()
        with self._lock:
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
