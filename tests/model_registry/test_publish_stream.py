"""The trainer's publish over the weights stream (model_registry/stream/publish.py), against a real
registry on real sockets: what it stores, and every refusal answered with its status, nothing stored,
the registry free for the next publish."""

from __future__ import annotations

import contextlib
import hashlib
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from overworld.core.blobs.store import LocalBlobStore
from overworld.core.grpc_util import serve, wait_healthy
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.server import ModelRegistryService, registration
from overworld.model_registry.stream import publish as publish_stream
from overworld.model_registry.stream.envelope import Envelope, StreamError
from overworld.model_registry.stream.protocol import (
    CALLER_SENDS,
    SERVER_SENDS,
    START,
    FrameWriter,
    WeightsStream,
    connect,
)
from overworld.v1 import model_registry_pb2 as pb

CHUNK = publish_stream.CHUNK_BYTES


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[tuple[ModelRegistryService, ModelRegistryClient, str]]:
    service = ModelRegistryService(LocalBlobStore(tmp_path / "blobs"))
    server = serve([registration(service)])
    wait_healthy(server.address)
    client = ModelRegistryClient(server.address)
    try:
        yield service, client, f"127.0.0.1:{service.publish_port}"
    finally:
        client.close()
        service.stop()
        server.stop(0)


def manifest_of(version: int, data: bytes) -> pb.VersionInfo:
    return pb.VersionInfo(version=version, size_bytes=len(data), dtype="float32")


def publish(address: str, version: int, data: bytes) -> pb.VersionInfo:
    return publish_stream.publish(address, manifest_of(version, data), memoryview(data), CHUNK, 30.0)


def refusal(address: str, version: int, data: bytes, frames: list[tuple[int, bytes]], end: bytes) -> grpc.StatusCode:
    """Send `frames` (index, bytes) and an END holding `end` as a publish of `data`'s manifest; the code
    the registry answers with (its ERROR frame must arrive, however much was still being sent)."""
    sock, key = connect(address, manifest_of(version, data).SerializeToString(), "model-registry")
    try:
        writer = FrameWriter(sock, key, address, CALLER_SENDS)
        try:
            for index, piece in frames:
                writer.data(index, memoryview(piece))
            writer.end(end)
        except OSError as err:
            pytest.fail(f"the registry stopped reading without draining: {err!r}")
        reader = WeightsStream(sock, key, 30.0, 30.0, lambda: False, space=SERVER_SENDS, end_bytes=1 << 16)
        try:
            reader.next(lambda i, n: memoryview(bytearray(n)))
        except StreamError as err:
            return err.code
        return grpc.StatusCode.OK
    finally:
        sock.close()


def test_the_trainer_publishes_over_the_stream_and_the_version_is_the_bytes_sent(registry) -> None:
    service, client, address = registry
    endpoint = client.call("GetPublishEndpoint", pb.PublishEndpointRequest(), timeout=10)
    assert endpoint.port == service.publish_port and endpoint.chunk_bytes == CHUNK
    data = bytes(range(256)) * (3 * CHUNK // 256 + 1000)  # three whole chunks and a short one
    info = client.publish(1, data)  # the client takes the stream: its endpoint is set
    assert info.version == 1 and info.sha256 == hashlib.sha256(data).hexdigest() and info.size_bytes == len(data)
    assert client.fetch(1)[1] == data
    assert publish(address, 1, data).sha256 == info.sha256  # the same bytes again: idempotent
    with pytest.raises(publish_stream.PublishFailed) as err:
        publish(address, 1, data[::-1])
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS


def test_a_manifest_that_cannot_be_published_is_refused_before_its_bytes(registry) -> None:
    service, client, address = registry
    client.publish(2, b"\0" * 1000)
    for manifest, code in [(pb.VersionInfo(version=1, size_bytes=10), grpc.StatusCode.FAILED_PRECONDITION),
                           (pb.VersionInfo(version=0, size_bytes=10), grpc.StatusCode.INVALID_ARGUMENT),
                           (pb.VersionInfo(version=3, size_bytes=10, sha256="ab"), grpc.StatusCode.INVALID_ARGUMENT),
                           (pb.VersionInfo(version=3, size_bytes=service.max_model_bytes + 1),
                            grpc.StatusCode.INVALID_ARGUMENT)]:
        started = time.monotonic()
        with pytest.raises(StreamError) as err:
            connect(address, manifest.SerializeToString(), "model-registry")
        assert err.value.code == code, (manifest, err.value)
        assert time.monotonic() - started < 5
    with pytest.raises(StreamError) as err:
        connect(address, b"\xff\xff\xff", "model-registry")  # not a VersionInfo
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "VersionInfo" in err.value.message


def test_bad_frames_are_answered_with_their_status_and_nothing_is_stored(registry) -> None:
    _, client, address = registry
    data = random.Random(1).randbytes(8 * CHUNK)
    whole = [(i, data[i * CHUNK:(i + 1) * CHUNK]) for i in range(8)]
    digest = hashlib.sha256(data).digest()
    assert refusal(address, 1, data, whole, b"\1" * 32) == grpc.StatusCode.DATA_LOSS  # not its sha256
    # out of order: refused at the first frame, with 7 more (28 MB) still to send; the ERROR arrives all the same
    assert refusal(address, 1, data, [whole[1], whole[0], *whole[2:]], digest) == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal(address, 1, data, [*whole, (8, b"x")], digest) == grpc.StatusCode.INVALID_ARGUMENT  # past the size
    assert refusal(address, 1, data, [(0, bytes(CHUNK + 1))], digest) == grpc.StatusCode.INVALID_ARGUMENT
    assert refusal(address, 1, data, whole[:7], digest) == grpc.StatusCode.INVALID_ARGUMENT  # short
    assert refusal(address, 1, data, whole, digest[:16]) == grpc.StatusCode.INVALID_ARGUMENT  # a short sha256
    assert client.list_versions() == []
    assert refusal(address, 1, data, whole, digest) == grpc.StatusCode.OK
    assert [v.version for v in client.list_versions()] == [1]


def test_a_trainer_that_goes_away_mid_publish_stores_nothing_and_frees_the_registry(registry) -> None:
    _, client, address = registry
    data = bytes(4 * CHUNK)
    sock, key = connect(address, manifest_of(1, data).SerializeToString(), "model-registry")
    FrameWriter(sock, key, address, CALLER_SENDS).data(0, memoryview(data)[:CHUNK])
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    deadline = time.monotonic() + 10
    while True:  # the publish lock is free again once the registry saw the connection end
        try:
            assert publish(address, 1, data).version == 1
            break
        except publish_stream.PublishFailed as err:
            assert err.code() == grpc.StatusCode.ABORTED and time.monotonic() < deadline, err
            time.sleep(0.1)


def test_a_restarted_registry_on_another_publish_port_is_found_again(tmp_path: Path) -> None:
    blobs = LocalBlobStore(tmp_path / "blobs")
    service = ModelRegistryService(blobs)
    server = serve([registration(service)])
    client = ModelRegistryClient(server.address)
    try:
        client.publish(1, b"a" * 5000)
        port = server.port
        service.stop()
        server.stop(0)
        service = ModelRegistryService(blobs)
        restarted: list[object] = []
        # the same gRPC port after a moment (as a pod's): the publish port is another free one
        threading.Timer(1.0, lambda: restarted.append(serve([registration(service)], port=port))).start()
        assert client.publish(2, b"b" * 5000, timeout=30).version == 2
        assert service.publish_port != 0 and [v.version for v in client.list_versions()] == [1, 2]
    finally:
        client.close()
        service.stop()
        for s in restarted:
            s.stop(0)  # type: ignore[attr-defined]


def test_a_registry_that_goes_silent_is_given_up_within_the_answer_stall(monkeypatch: pytest.MonkeyPatch) -> None:
    """A deleted pod's connection never closes: a registry that took the bytes and then says nothing is
    taken for gone after ANSWER_STALL (then the publish is tried again), not after the whole timeout."""
    monkeypatch.setattr(publish_stream, "ANSWER_STALL", 1.0)
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def silent_registry() -> None:  # plaintext: answers OK, reads everything, never answers the publish
        conn, _ = listener.accept()
        held.append(conn)
        envelope = Envelope(conn, None, server=True)
        envelope.receive(1 << 16)
        envelope.send(b"\0")  # OK, and no key (plaintext)
        envelope.receive(len(START))
        conn.settimeout(10)
        with contextlib.suppress(OSError):
            while conn.recv(1 << 20):
                pass

    threading.Thread(target=silent_registry, daemon=True).start()
    data = bytes(CHUNK)
    started = time.monotonic()
    with pytest.raises(publish_stream.PublishFailed) as err:
        publish_stream.publish(f"127.0.0.1:{listener.getsockname()[1]}", manifest_of(1, data), memoryview(data),
                               CHUNK, 60.0)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 5
    for conn in held:
        conn.close()
    listener.close()


def test_keepalives_carry_a_publish_through_a_slow_store(registry, monkeypatch: pytest.MonkeyPatch) -> None:
    """Storing a version may take longer than the answer stall (a slow object store): the registry's
    keep-alives say it lives, and the publish completes."""
    service, client, address = registry
    monkeypatch.setattr(publish_stream, "ANSWER_STALL", 1.0)
    monkeypatch.setattr(publish_stream, "KEEPALIVE_SECONDS", 0.2)
    slow = service._store

    def slow_store(key: str, payload: object) -> None:
        time.sleep(3.0)
        slow(key, payload)  # type: ignore[arg-type]

    monkeypatch.setattr(service, "_store", slow_store)
    data = bytes(range(256)) * 4096
    assert publish(address, 1, data).sha256 == hashlib.sha256(data).hexdigest()
