"""The weights stream's handshake (model_registry/stream/envelope.py) takes no byte beyond it: a
publisher sends its first frames right after "start", often in the same TCP segment, and those bytes
must stay on the socket for the frame reader."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from overworld.core.security import tls
from overworld.model_registry.stream.envelope import Envelope, contexts
from overworld.model_registry.stream.protocol import START

FRAMES = b"the first sealed frames " * 2000  # 48 KB: more than a TLS record's worth


@pytest.fixture
def identities(tmp_path: Path) -> dict[str, Path]:
    return tls.write_run_credentials(tmp_path, "envelope-run")


def test_the_bytes_after_start_stay_on_the_socket_for_the_frames(identities: dict[str, Path]) -> None:
    server_ctx = contexts.get(tls.CredentialFiles(identities["model-registry"]), server=True)
    client_ctx = contexts.get(tls.CredentialFiles(identities["trainer"]), server=False)
    assert server_ctx is not None and client_ctx is not None
    ours, theirs = socket.socketpair()
    got: dict[str, object] = {}

    def client() -> None:
        envelope = Envelope(theirs, client_ctx[0], server=False, peer="model-registry")
        envelope.send(b"the request")
        got["answer"] = envelope.receive(64)
        assert envelope.obj is not None
        envelope.obj.write(len(START).to_bytes(4, "big") + START)
        theirs.sendall(envelope._out.read() + FRAMES)  # "start" and the frames in one segment

    thread = threading.Thread(target=client)
    thread.start()
    server = Envelope(ours, server_ctx[0], server=True)
    assert server.receive(64) == b"the request"
    server.send(b"ok")
    thread.join(10)
    assert got["answer"] == b"ok"
    assert server.receive(len(START)) == START
    server.finish()  # nothing of the frames went into TLS's buffer
    ours.settimeout(5)
    rest = b""
    while len(rest) < len(FRAMES):
        rest += ours.recv(65536)
    assert rest == FRAMES
    ours.close()
    theirs.close()
