"""Every wait of the weights stream has an overall deadline, shown by real slow and hostile peers on real
sockets: a handshake that drips a byte now and then, a flood of connections from one host, a reader that
takes a frame a byte at a time, a relay that drips its chunk, a request for chunks of another size. Each
is cut off in time, and an honest worker still gets its version meanwhile (the deadlines are shortened
for the test, as each says)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from overworld.core.blobs.store import LocalBlobStore
from overworld.core.grpc_util import serve
from overworld.core.security import authz, tls
from overworld.core.wire import weights
from overworld.model_registry.relay_plan import relay_chunk_bytes
from overworld.model_registry.server import ModelRegistryService, registration
from overworld.model_registry.stream import envelope as envelope_module
from overworld.model_registry.stream import protocol as stream_module
from overworld.model_registry.stream import server as stream_server
from overworld.model_registry.stream.protocol import DATA, END, FrameWriter, Stalled, StreamError, open_stream
from overworld.model_registry.stream.server import WeightsStreamServer
from overworld.v1 import model_registry_pb2 as pb

RUN = "deadline-run"
SIZE = 300_000 * 4  # version 1: 300,000 floats
BIG = 32 << 20  # version 2


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tls.write_run_credentials(tmp_path_factory.mktemp("tls"), RUN)


@pytest.fixture(scope="module")
def registry(identities: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A registry holding version 1: its weights stream's address."""
    import torch

    tls.use(identities["model-registry"])
    service = ModelRegistryService(LocalBlobStore(tmp_path_factory.mktemp("blobs")))
    server = serve([registration(service)])
    try:
        tls.use(identities["trainer"])
        from overworld.model_registry.client import ModelRegistryClient

        with ModelRegistryClient(server.address) as client:
            client.publish(1, weights.to_bytes({"w": torch.arange(300_000, dtype=torch.float32)}))
            # larger than the sockets' buffers, for the slow reader
            client.publish(2, weights.to_bytes({"w": torch.zeros(BIG // 4, dtype=torch.float32)}))
        yield f"127.0.0.1:{service.weights_port}"
    finally:
        tls.reset()
        service.stop()
        server.stop(0)


def request(chunk: int | None = None, version: int = 1) -> pb.FetchRequest:
    payload = (SIZE if version == 1 else BIG) + 200  # the safetensors header beside the floats
    return pb.FetchRequest(version=version, chunk_size=chunk or relay_chunk_bytes(payload))


def honest_fetch(address: str) -> int:
    """A worker's whole fetch of version 1 from the registry: the bytes received (StreamError if refused)."""
    out = bytearray(4 << 20)
    got = 0
    stream = open_stream(address, request(), 5.0, 15.0, lambda: False, "model-registry")
    try:
        while (frame := stream.next(lambda i, n: memoryview(out)[:n])).kind != END:
            got += frame.length if frame.kind == DATA else 0
    finally:
        stream.close()
    return got


def connect_from(address: str, source: str) -> socket.socket:
    """A TCP connection to `address` from the loopback address `source` (another host, to the server)."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect((host, int(port)))
    return sock


def closed_within(sock: socket.socket, seconds: float, drip: bytes = b"") -> float | None:
    """Seconds until the server closes `sock` (None: still open after `seconds`), dripping `drip` a byte
    every 0.3 s meanwhile (a slowloris)."""
    started = time.monotonic()
    sock.settimeout(0.3)
    sent = 0
    while time.monotonic() - started < seconds:
        try:
            if sock.recv(4096) == b"":
                return time.monotonic() - started
        except TimeoutError:
            pass
        except OSError:
            return time.monotonic() - started
        if drip:
            try:
                sock.send(drip[sent % len(drip):sent % len(drip) + 1])
                sent += 1
            except OSError:
                return time.monotonic() - started
    return None


def test_a_slowloris_handshake_is_cut_off_at_the_deadline_and_others_get_their_version(
        identities: dict[str, Path], registry: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The handshake, request and start have HANDSHAKE_SECONDS in all (here 1.5 s), not per read: three
    clients without certificates sending a byte every 0.3 s are dropped in time."""
    monkeypatch.setattr(envelope_module, "HANDSHAKE_SECONDS", 1.5)
    drippers = [connect_from(registry, f"127.0.0.{2 + i}") for i in range(3)]
    results: list[float | None] = [None] * 3
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, closed_within(drippers[i], 6.0, b"\x16\x03\x01\x02\x00")), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    tls.use(identities["rollout-worker"])
    assert honest_fetch(registry) > SIZE  # meanwhile, an honest worker
    for t in threads:
        t.join(10)
    for sock in drippers:
        sock.close()
    assert all(r is not None and r < 1.5 + 1.0 for r in results), results


def test_a_flood_of_connections_from_one_host_takes_only_its_share(
        identities: dict[str, Path], registry: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stream_server, "MAX_CONNECTIONS_PER_PEER", 4)
    flood = [connect_from(registry, "127.0.0.9") for _ in range(12)]
    try:
        time.sleep(0.5)
        open_ones = [s for s in flood if closed_within(s, 0.4) is None]
        assert len(open_ones) == 4, len(open_ones)  # the rest closed at once
        tls.use(identities["rollout-worker"])
        assert honest_fetch(registry) > SIZE  # from another host: served
    finally:
        for sock in flood:
            sock.close()


def test_a_reader_that_takes_a_byte_at_a_time_is_cut_off(identities: dict[str, Path], registry: str,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A frame has SEND_SECONDS + its size / MIN_RATE to be taken (here 1 s + at 100 MB/s); a reader
    that takes a few hundred bytes a second no longer pins a thread and a version's buffer."""
    monkeypatch.setattr(stream_module, "SEND_SECONDS", 1.0)
    monkeypatch.setattr(stream_module, "MIN_RATE", 100 << 20)
    tls.use(identities["rollout-worker"])
    caplog.set_level(logging.WARNING, logger="overworld.model_registry.stream.protocol")
    stream = open_stream(registry, request(version=2), 5.0, 15.0, lambda: False, "model-registry")
    try:
        started = time.monotonic()
        while time.monotonic() - started < 8 and not any("cut off" in r.message for r in caplog.records):
            stream.sock.settimeout(1.0)
            with contextlib.suppress(TimeoutError, OSError):
                stream.sock.recv(64)
            time.sleep(0.2)
        cut = [r.message for r in caplog.records if "cut off" in r.message]
        assert cut and "too slowly" in cut[0], [r.message for r in caplog.records]
        assert time.monotonic() - started < 1.0 + 4.0
    finally:
        stream.close()
    assert honest_fetch(registry) > SIZE


def test_a_chunk_size_other_than_the_announced_one_is_refused(identities: dict[str, Path], registry: str) -> None:
    """Chunks are the registry's size: a request for 64 MB chunks (memory at the server, a hash nobody
    announced) is refused."""
    tls.use(identities["rollout-worker"])
    stream = open_stream(registry, request(64 << 20), 5.0, 15.0, lambda: False, "model-registry")
    with pytest.raises(StreamError) as err:
        stream.next(lambda i, n: memoryview(bytearray(n)))
    stream.close()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "chunks of its announcement" in err.value.message


class Dripping:
    """A socket that passes on a few bytes at a time, slowly: a relay dripping its chunk."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def sendmsg(self, views: list[Any]) -> int:
        time.sleep(0.05)
        return self._sock.send(bytes(views[0][:64]))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def dripping_relay() -> WeightsStreamServer:
    def handler(request: pb.FetchRequest, writer: FrameWriter, active: Callable[[], bool]) -> None:
        writer.sock = Dripping(writer.sock)  # type: ignore[assignment]
        writer.data(0, memoryview(bytes(request.chunk_size)))

    return WeightsStreamServer(authz.WEIGHTS_FROM_RELAY, handler)


def test_a_dripping_relay_cannot_stretch_a_fetch_past_its_deadline(identities: dict[str, Path]) -> None:
    """Bytes keep coming (no stall), but the fetch's deadline ends the stream with the frame under way,
    not when the frame is done (a chunk at 1.3 KB/s would take minutes)."""
    tls.use(identities["rollout-worker"])
    relay = dripping_relay()
    try:
        started = time.monotonic()
        stream = open_stream(f"127.0.0.1:{relay.port}", request(), 5.0, 15.0, lambda: False, "rollout-worker",
                             deadline=started + 1.5)
        out = bytearray(4 << 20)
        with pytest.raises(Stalled, match="deadline"):
            stream.next(lambda i, n: memoryview(out)[:n])
        stream.close()
        assert time.monotonic() - started < 1.5 + 1.0
    finally:
        relay.stop()


def test_a_dripping_relay_is_cut_off_under_the_minimum_rate_without_a_deadline(identities: dict[str, Path]) -> None:
    """With no fetch deadline at all, a chunk whose bytes keep coming but slower than MIN_RATE ends the
    stream as stalled (the relay layer reports it and fetches from the registry) within the data stall
    time and the chunk's length at MIN_RATE."""
    tls.use(identities["rollout-worker"])
    relay = dripping_relay()
    try:
        started = time.monotonic()
        wanted = request()
        stream = open_stream(f"127.0.0.1:{relay.port}", wanted, 5.0, 1.0, lambda: False, "rollout-worker")
        out = bytearray(4 << 20)
        with pytest.raises(Stalled, match="minimum rate"):
            stream.next(lambda i, n: memoryview(out)[:n])
        stream.close()
        assert time.monotonic() - started < 1.0 + wanted.chunk_size / stream_module.MIN_RATE + 1.5
    finally:
        relay.stop()

