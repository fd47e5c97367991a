import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from overworld.core.blobs.store import LocalBlobStore
from overworld.core.grpc_util import Server, serve, wait_healthy
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.server import ModelRegistryService, registration
from overworld.v1 import model_registry_pb2 as pb
from overworld.v1 import model_registry_pb2_grpc


def start(root: Path, retain: int = 20, fast: bool = True) -> tuple[Server, ModelRegistryService]:
    """fast: registration() (hand-encoded Publish / Fetch); else the generated add function, which
    overworld.serve uses today: both must behave the same."""
    service = ModelRegistryService(LocalBlobStore(root), retain=retain)
    server = serve([registration(service) if fast else (model_registry_pb2_grpc.add_ModelRegistryServicer_to_server,
                                                        service, "overworld.v1.ModelRegistry")])
    wait_healthy(server.address)
    return server, service


@pytest.fixture(params=["fast", "generated"])
def registry(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Server, ModelRegistryClient]]:
    server, service = start(tmp_path / "blobs", fast=request.param == "fast")
    client = ModelRegistryClient(server.address)
    yield server, client
    service.stop()
    server.stop(0)


def test_publish_fetch_list_and_tags(registry) -> None:
    _, client = registry
    data = bytes(range(256)) * 20_000  # 5 MB: several chunks each way
    info = client.publish(1, data, counters={"updates": 3}, config_hash="abc", tags=["reference"])
    assert info.version == 1 and info.size_bytes == len(data) and "latest" in info.tags
    fetched, got = client.fetch()
    assert got == data and fetched.sha256 == hashlib.sha256(data).hexdigest() and fetched.counters["updates"] == 3
    client.publish(2, b"v2", parent=1)
    assert [v.version for v in client.list_versions()] == [1, 2]
    assert client.fetch(tag="reference")[1] == data
    assert client.fetch()[1] == b"v2"
    client.set_tag("best", 1)
    assert client.fetch(tag="best")[1] == data


def test_fetch_resumes_from_an_offset(registry) -> None:
    _, client = registry
    client.publish(1, b"0123456789")
    chunks = list(client.call("Fetch", pb.FetchRequest(version=1, offset=4, chunk_size=3), timeout=30))
    assert b"".join(c.data for c in chunks) == b"456789" and chunks[0].offset == 4


def test_corrupted_chunk_is_refused_and_nothing_is_stored(registry) -> None:
    _, client = registry
    good = b"weights" * 1000
    manifest = pb.VersionInfo(version=1, size_bytes=len(good))
    sha256 = pb.PublishRequest(sha256=hashlib.sha256(good).hexdigest())
    corrupted = bytearray(good)
    corrupted[10] ^= 0xFF

    def publish(*messages: pb.PublishRequest) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as err:
            client.call("Publish", iter([pb.PublishRequest(manifest=manifest), *messages]), timeout=30)
        return err.value.code()

    assert publish(pb.PublishRequest(chunk=bytes(corrupted)), sha256) == grpc.StatusCode.DATA_LOSS
    assert client.list_versions() == []
    assert publish(pb.PublishRequest(chunk=good[:-1]), sha256) == grpc.StatusCode.INVALID_ARGUMENT
    assert publish(pb.PublishRequest(chunk=good)) == grpc.StatusCode.INVALID_ARGUMENT  # no sha256
    assert publish(pb.PublishRequest(chunk=good), pb.PublishRequest(sha256="short")) == grpc.StatusCode.INVALID_ARGUMENT
    assert publish(pb.PublishRequest(chunk=good), sha256, sha256) == grpc.StatusCode.INVALID_ARGUMENT
    assert client.list_versions() == []
    assert client.publish(1, good).version == 1


def test_versions_only_move_forward(registry) -> None:
    _, client = registry
    client.publish(5, b"a")
    with pytest.raises(grpc.RpcError) as err:
        client.publish(3, b"b")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert client.publish(5, b"a").version == 5  # a retried publish of the same bytes is idempotent
    with pytest.raises(grpc.RpcError) as err:
        client.publish(5, b"different")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as err:
        client.fetch(version=99)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_pushes_every_new_version(registry) -> None:
    _, client = registry
    client.publish(1, b"one")
    seen: list[int] = []
    stream = client.call("Watch", pb.WatchRequest(watcher_id="w", known_version=0), timeout=60)
    got_first, got_three = threading.Event(), threading.Event()

    def consume() -> None:
        for info in stream:  # the plain Watch: VersionInfo, as an older release's watchers read it
            seen.append(info.version)
            got_first.set()
            if info.version == 3:
                got_three.set()
                return

    t = threading.Thread(target=consume)
    t.start()
    assert got_first.wait(10)  # the first message says where the registry is when the stream opens
    client.publish(2, b"two")
    client.publish(3, b"three")
    assert got_three.wait(10)
    stream.cancel()
    t.join(5)
    assert seen[0] == 1 and seen[-1] == 3 and seen == sorted(seen)


def test_restart_keeps_versions_and_retention_drops_old_ones(tmp_path: Path) -> None:
    server, service = start(tmp_path / "blobs", retain=2)
    client = ModelRegistryClient(server.address)
    for v in range(1, 5):
        client.publish(v, f"v{v}".encode(), tags=["reference"] if v == 1 else [])
    service.stop()
    server.stop(0)
    server, service = start(tmp_path / "blobs", retain=2)
    with ModelRegistryClient(server.address) as restarted:
        versions = {v.version: list(v.tags) for v in restarted.list_versions()}
    assert versions == {1: ["reference"], 3: [], 4: ["latest"]}  # tagged versions are always retained
    service.stop()
    server.stop(0)


def test_bad_manifest_is_invalid_argument(registry) -> None:
    _, client = registry
    for manifest in (pb.VersionInfo(version=0), pb.VersionInfo(version=1, sha256="0" * 64)):
        with pytest.raises(grpc.RpcError) as err:
            client.call("Publish", iter([pb.PublishRequest(manifest=manifest)]), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        client.call("Publish", iter([pb.PublishRequest(chunk=b"x")]), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
