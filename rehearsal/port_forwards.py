"""Port-forwards from this machine into a pod's namespace, and plain HTTP GETs to a pod."""

from __future__ import annotations

import contextlib
import socket
import socketserver
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from rehearsal.api_server import ApiServer


class PortForwards(ApiServer):
    def forward(self, target: str, port: int) -> str:
        """A Unix socket in this machine's filesystem that reaches `target:port` inside the cluster
        (a Service name, or a pod IP); returns the gRPC target `unix:PATH`."""
        path = self.socket_dir / f"{target[:60]}-{port}.sock"  # AF_UNIX paths are short
        if path.exists():
            return f"unix:{path}"
        cluster = self

        class Relay(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                address = cluster.resolve(target)
                if address is None:
                    return
                try:
                    upstream = socket.create_connection((address, port), timeout=5)
                except OSError:
                    return
                upstream.settimeout(None)
                pipes = [threading.Thread(target=relay_bytes, args=(self.request, upstream), daemon=True),
                         threading.Thread(target=relay_bytes, args=(upstream, self.request), daemon=True)]
                for pipe in pipes:
                    pipe.start()
                for pipe in pipes:
                    pipe.join()

        server = socketserver.ThreadingUnixStreamServer(str(path), Relay)
        server.daemon_threads = True
        self._servers.append(server)
        self._run_in_control(server.serve_forever, f"forward-{target}")
        return f"unix:{path}"

    def http_get(self, target: str, port: int, path: str, timeout: float = 10) -> tuple[int, bytes]:
        """An HTTP GET to `target:port` in the cluster through a port-forward (from the node, which every
        NetworkPolicy lets in): (status, body)."""
        import http.client

        socket_path = self.forward(target, port).removeprefix("unix:")

        class UnixHTTP(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(timeout)
                self.sock.connect(socket_path)

        connection = UnixHTTP("localhost", timeout=timeout)
        try:
            connection.request("GET", path)
            reply = connection.getresponse()
            return reply.status, reply.read()
        finally:
            connection.close()


def relay_bytes(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            data = source.recv(65536)
            if not data:
                break
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
