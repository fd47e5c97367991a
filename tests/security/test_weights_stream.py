"""The weights stream (model_registry/stream/protocol.py) is guarded as the gRPC services are, over real
sockets: the registry's and a worker's relay port refuse a plaintext client and a client of another CA
at the handshake, answer PERMISSION_DENIED (naming the caller and the endpoint) to every identity the
table does not give the endpoint, and take the rollout-worker identity; a frame changed on the way
is refused; a request that is not one is answered, not crashed on."""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from overworld.core.blobs.store import LocalBlobStore
from overworld.core.grpc_util import serve
from overworld.core.security import authz, tls
from overworld.core.wire import weights
from overworld.model_registry.relay_plan import relay_chunk_bytes
from overworld.model_registry.server import ModelRegistryService, registration
from overworld.model_registry.stream import protocol as stream_module
from overworld.model_registry.stream import publish as publish_stream
from overworld.model_registry.stream.protocol import END, StreamError, WeightsStream, open_stream
from overworld.model_registry.worker.relay import RelayShelf, serve_relay
from overworld.v1 import model_registry_pb2 as pb

RUN = "stream-run"


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return tls.write_run_credentials(tmp_path_factory.mktemp("tls"), RUN)


@pytest.fixture(scope="module")
def endpoints(identities: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A registry holding version 1 (its weights stream) and a worker's relay, each with its identity."""
    import torch

    tls.use(identities["model-registry"])
    service = ModelRegistryService(LocalBlobStore(tmp_path_factory.mktemp("blobs")))
    server = serve([registration(service)])
    tls.use(identities["rollout-worker"])
    relay = serve_relay(RelayShelf())
    try:
        tls.use(identities["trainer"])
        from overworld.model_registry.client import ModelRegistryClient

        client = ModelRegistryClient(server.address)
        VERSION_1.append(weights.to_bytes({"w": torch.arange(300_000, dtype=torch.float32)}))
        client.publish(1, VERSION_1[0])
        client.close()
        yield {authz.WEIGHTS_FROM_REGISTRY: f"127.0.0.1:{service.weights_port}",
               authz.WEIGHTS_FROM_RELAY: f"127.0.0.1:{relay.port}",
               authz.WEIGHTS_PUBLISH: f"127.0.0.1:{service.publish_port}"}
    finally:
        tls.reset()
        relay.stop()
        service.stop()
        server.stop(0)


# whose certificate each endpoint's server presents: the identity a client of it means to reach
PEER = {authz.WEIGHTS_FROM_REGISTRY: "model-registry", authz.WEIGHTS_FROM_RELAY: "rollout-worker",
        authz.WEIGHTS_PUBLISH: "model-registry"}
VERSION_1: list[bytes] = []  # the bytes the registry holds as version 1


def request(version: int = 1) -> pb.FetchRequest:
    return pb.FetchRequest(version=version, chunk_size=relay_chunk_bytes(1))


def answer(address: str, peer: str = "model-registry", method: str = authz.WEIGHTS_FROM_REGISTRY) -> grpc.StatusCode:
    """What the endpoint answers this process's identity (OK: it streamed the whole version, sealed; the
    publish port: it took version 1 again, the same bytes)."""
    if method == authz.WEIGHTS_PUBLISH:
        manifest = pb.VersionInfo(version=1, size_bytes=len(VERSION_1[0]), dtype="float32")
        try:
            publish_stream.publish(address, manifest, memoryview(VERSION_1[0]), publish_stream.CHUNK_BYTES, 15.0)
        except publish_stream.PublishFailed as err:
            return err.code()
        return grpc.StatusCode.OK
    out = bytearray(8 << 20)
    try:
        stream = open_stream(address, request(), 5.0, 15.0, lambda: False, peer)
        try:
            while stream.next(lambda i, n: memoryview(out)[:n]).kind != END:
                pass
        finally:
            stream.close()
    except StreamError as err:
        return err.code
    return grpc.StatusCode.OK


def test_each_identity_may_use_exactly_the_endpoints_the_table_gives_it(identities: dict[str, Path],
                                                                        endpoints: dict[str, str]) -> None:
    assert set(endpoints) == set(authz.STREAM_METHODS)
    for identity in authz.IDENTITIES:
        tls.use(identities[identity])
        for method, address in endpoints.items():
            if authz.allowed(identity, method):
                # the registry streams version 1; the relay holds nothing: NOT_FOUND, past the check
                assert answer(address, PEER[method], method) in (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND), (
                    identity, method)
                continue
            with pytest.raises(StreamError) as err:
                open_stream(address, request(), 5.0, 15.0, lambda: False, PEER[method])
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED, (identity, method, err.value)
            assert identity in err.value.message and method in err.value.message, err.value.message
    assert authz.callers(authz.WEIGHTS_FROM_RELAY) == ["rollout-worker"]
    assert authz.callers(authz.WEIGHTS_PUBLISH) == ["trainer"]


def test_a_plaintext_client_and_a_client_of_another_ca_are_refused_at_the_handshake(
        endpoints: dict[str, str], tmp_path: Path) -> None:
    tls.use(None)
    for method, address in endpoints.items():
        with pytest.raises((OSError, ssl.SSLError, StreamError)) as err:
            open_stream(address, request(), 5.0, 15.0, lambda: False, PEER[method])
        assert not (isinstance(err.value, StreamError) and err.value.code == grpc.StatusCode.OK)
    other = tls.write_run_credentials(tmp_path, RUN)  # same run and identity names, another CA
    tls.use(other["rollout-worker"])
    for method, address in endpoints.items():
        with pytest.raises(ssl.SSLError):
            open_stream(address, request(), 5.0, 15.0, lambda: False, PEER[method])


def test_a_stream_server_of_another_identity_is_refused(identities: dict[str, Path],
                                                         endpoints: dict[str, str]) -> None:
    """A certificate of the run is not enough: a worker's relay port asked as if it were the registry, and
    the registry's asked as if it were a relay, are refused at the handshake, naming both identities."""
    tls.use(identities["rollout-worker"])
    for method, meant in ((authz.WEIGHTS_FROM_RELAY, "model-registry"), (authz.WEIGHTS_FROM_REGISTRY, "rollout-worker")):
        with pytest.raises(StreamError) as err:
            open_stream(endpoints[method], request(), 5.0, 15.0, lambda: False, meant)
        presented = PEER[method]
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED, err.value
        assert f"presented {presented}'s certificate of run {RUN}, not the {meant}" in err.value.message, err.value


def test_a_worker_of_another_run_from_the_same_issuer_is_refused(endpoints: dict[str, str], tmp_path: Path,
                                                                  identities: dict[str, Path]) -> None:
    """A certificate naming another run, from the same CA (the run's CA key is gone, so a shared issuer
    is imitated with a fresh CA for both sides)."""
    ca = tls.Authority.create("shared")
    for run, identity in ((RUN, "rollout-worker"), ("other-run", "rollout-worker")):
        tls.write_identity(tmp_path / run / identity, ca.pem, *ca.issue(identity, run))
    tls.use(tmp_path / RUN / "rollout-worker")
    relay = serve_relay(RelayShelf())
    try:
        tls.use(tmp_path / "other-run" / "rollout-worker")
        with pytest.raises(StreamError) as err:
            open_stream(f"127.0.0.1:{relay.port}", request(), 5.0, 15.0, lambda: False, "rollout-worker")
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED and "other-run" in err.value.message
    finally:
        relay.stop()


def flip_a_byte_of_each_sealed_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A man in the middle without the connection's key: one byte of each sealed chunk flipped between
    the sockets."""
    received = WeightsStream._fill

    def flip(self: WeightsStream, view: memoryview) -> None:
        received(self, view)
        if len(view) > 1000:  # a sealed chunk
            view[100] ^= 0x01

    monkeypatch.setattr(WeightsStream, "_fill", flip)


def test_a_frame_changed_on_the_way_is_refused(identities: dict[str, Path], endpoints: dict[str, str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """AES-GCM over each frame: a byte flipped between the sockets (a man in the middle without the
    connection's key) is DATA_LOSS, not a chunk."""
    tls.use(identities["rollout-worker"])
    flip_a_byte_of_each_sealed_chunk(monkeypatch)
    stream = open_stream(endpoints[authz.WEIGHTS_FROM_REGISTRY], request(), 5.0, 15.0, lambda: False, "model-registry")
    out = bytearray(8 << 20)
    try:
        with pytest.raises(StreamError) as err:
            while stream.next(lambda i, n: memoryview(out)[:n]).kind != END:
                pass
        assert err.value.code == grpc.StatusCode.DATA_LOSS
    finally:
        stream.close()


def test_a_request_that_is_not_one_is_answered(identities: dict[str, Path], endpoints: dict[str, str]) -> None:
    tls.use(identities["rollout-worker"])
    files = tls.credentials()
    assert files is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(files.directory / tls.CERT, files.directory / tls.KEY)
    ctx.load_verify_locations(files.directory / tls.CA)
    # bytes that are not a FetchRequest; a length of 1 GB
    for sent in (struct.pack("!I", 40) + b"\xff" * 40, struct.pack("!I", 1 << 30)):
        host, port = endpoints[authz.WEIGHTS_FROM_REGISTRY].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=tls.server_name("model-registry")) as conn:
            conn.sendall(sent)
            n = struct.unpack("!I", conn.recv(4))[0]
            reply = conn.recv(n)
            assert reply[0] == grpc.StatusCode.INVALID_ARGUMENT.value[0], reply
    # and the endpoint still serves
    assert answer(endpoints[authz.WEIGHTS_FROM_REGISTRY]) == grpc.StatusCode.OK


def test_a_caller_is_refused_before_its_request_is_read(identities: dict[str, Path], endpoints: dict[str, str]) -> None:
    """Authorization comes straight after the handshake: an identity the table refuses gets
    PERMISSION_DENIED even for bytes that are not a request (they are never parsed)."""
    tls.use(identities["gae"])  # may use neither endpoint
    files = tls.credentials()
    assert files is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(files.directory / tls.CERT, files.directory / tls.KEY)
    ctx.load_verify_locations(files.directory / tls.CA)
    host, port = endpoints[authz.WEIGHTS_FROM_REGISTRY].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname=tls.server_name("model-registry")) as conn:
        conn.sendall(struct.pack("!I", 40) + b"\xff" * 40)  # not a FetchRequest
        n = struct.unpack("!I", conn.recv(4))[0]
        reply = conn.recv(n)
    assert reply[0] == grpc.StatusCode.PERMISSION_DENIED.value[0], reply
    assert b"gae" in reply


@pytest.mark.parametrize("in_place", [True, False], ids=["cryptography-46+", "cryptography-45"])
def test_the_whole_version_arrives_sealed_with_either_aead_api(identities: dict[str, Path], endpoints: dict[str, str],
                                                                monkeypatch: pytest.MonkeyPatch, in_place: bool) -> None:
    """MineStudio's environment holds cryptography 45 (no encrypt_into/decrypt_into): frames are sealed
    and opened with a copy there, the same bytes; a flipped byte is still DATA_LOSS."""
    import torch

    monkeypatch.setattr(stream_module, "IN_PLACE", in_place)
    tls.use(identities["rollout-worker"])
    chunk, out, end = relay_chunk_bytes(1), bytearray(8 << 20), 0

    def into(index: int, n: int) -> memoryview:
        nonlocal end
        end = max(end, index * chunk + n)
        return memoryview(out)[index * chunk:index * chunk + n]

    stream = open_stream(endpoints[authz.WEIGHTS_FROM_REGISTRY], request(), 5.0, 15.0, lambda: False, "model-registry")
    try:
        while stream.next(into).kind != END:
            pass
    finally:
        stream.close()
    assert weights.from_bytes(bytes(out[:end]))["w"].equal(torch.arange(300_000, dtype=torch.float32))
    flip_a_byte_of_each_sealed_chunk(monkeypatch)
    assert answer(endpoints[authz.WEIGHTS_FROM_REGISTRY]) == grpc.StatusCode.DATA_LOSS
