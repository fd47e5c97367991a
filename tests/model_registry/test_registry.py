"""The registry in depth, in-process on real sockets: wire encoding, half precision, watch catch-up,
tags and retention across restarts, push status and metrics, cut-through publishing, resumed fetches,
and the S3 blob store."""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from overworld.core.blobs.store import BlobStore, LocalBlobStore
from overworld.core.blobs.urls import open_blob_store
from overworld.core.grpc_util import Server, serve, wait_healthy
from overworld.core.wire import safetensors_format, weights
from overworld.model_registry import wire
from overworld.model_registry.client import FetchBroken, ModelRegistryClient
from overworld.model_registry.server import (
    ModelRegistryService,
    Payload,
    message_bounds,
    registration,
    weights_key,
)
from overworld.model_registry.worker.watcher import WeightsWatcher
from overworld.v1 import model_registry_pb2 as pb


class Running:
    def __init__(self, blobs: BlobStore, port: int = 0, **kwargs: object) -> None:
        self.service = ModelRegistryService(blobs, **kwargs)  # type: ignore[arg-type]
        self.server: Server = serve([registration(self.service)], port=port)
        wait_healthy(self.server.address)
        self.client = ModelRegistryClient(self.server.address)

    def stop(self) -> None:
        self.client.close()
        self.service.stop()
        self.server.stop(0)


@pytest.fixture
def reg(tmp_path: Path) -> Iterator[Running]:
    running = Running(LocalBlobStore(tmp_path / "blobs"), chunk_size=1 << 16)
    yield running
    running.stop()


def model(value: float, n: int = 50_000) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), value) + torch.arange(n) / n, "steps": torch.tensor([int(value)])}


# -- wire and weights ------------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [0, 1, 300, 1 << 33])
@pytest.mark.parametrize("size", [0, 1, 200, 70_000])
def test_hand_encoded_messages_are_what_protobuf_makes(offset: int, size: int) -> None:
    data = bytes(i % 251 for i in range(size))
    assert wire.encode_chunk(offset, data) == pb.WeightsChunk(offset=offset, data=data).SerializeToString()
    chunk = wire.decode_chunk(pb.WeightsChunk(info=pb.VersionInfo(version=7), offset=offset, data=data).SerializeToString())
    assert chunk.info is not None and chunk.info.version == 7 and chunk.offset == offset and bytes(chunk.data) == data
    assert wire.encode_publish_chunk(data) == pb.PublishRequest(chunk=data).SerializeToString()
    part = wire.decode_publish(wire.encode_publish_chunk(data))
    assert part.manifest is None and part.chunk is not None and bytes(part.chunk) == data
    manifest = pb.VersionInfo(version=3, counters={"updates": 2})
    assert wire.decode_publish(wire.encode_publish_manifest(manifest)).manifest == manifest
    assert wire.decode_publish(wire.encode_publish_sha256("a" * 64)) == wire.PublishPart(sha256="a" * 64)


def test_weights_views_and_half_precision() -> None:
    state = {"a": torch.randn(3, 5), "i": torch.arange(7), "m": torch.tensor([True, False]),
             "h": torch.randn(4).to(torch.bfloat16), "e": torch.empty(0, 2), "d": torch.randn(2).double()}
    data = weights.to_bytes(state)
    buf = bytearray(data) + bytearray(10)  # a reused buffer may be longer than the payload
    got = weights.from_buffer(buf, size=len(data))
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v)
    got["a"][0, 0] = 42.0  # a view: writes land in the buffer
    assert weights.from_buffer(buf, size=len(data))["a"][0, 0] == 42.0
    half = safetensors_format.convert(data, "float16")
    assert safetensors_format.payload_dtype(half) == "float16" and safetensors_format.payload_dtype(data) == "mixed" and len(half) < len(data)
    back = weights.from_buffer(bytearray(half), like=state)
    assert back["a"].dtype == torch.float32 and torch.equal(back["a"], state["a"].half().float())
    assert torch.equal(back["i"], state["i"]) and back["m"].dtype == torch.bool
    with pytest.raises(ValueError):
        weights.from_buffer(bytearray(b"not safetensors at all"))
    with pytest.raises(ValueError):
        weights.half_dtype("int4")


# -- fetch ---------------------------------------------------------------------------------------------
def test_half_precision_fetch_is_cast_back_by_the_watcher(reg: Running) -> None:
    state = model(1.0)
    data = weights.to_bytes(state)
    assert reg.client.publish(1, data).dtype == "float32"
    info, half = reg.client.fetch(precision="bfloat16")
    assert info.dtype == "bfloat16" and info.sha256 == hashlib.sha256(half).hexdigest()
    assert info.size_bytes == len(half) < 0.6 * len(data)
    watcher = WeightsWatcher(reg.server.address, "half", state, precision="bfloat16")
    try:
        version, got = watcher.wait_first(threading.Event())  # type: ignore[misc]
    finally:
        watcher.close()
    assert version == 1 and got["w"].dtype == torch.float32
    assert torch.equal(got["w"], state["w"].to(torch.bfloat16).float()) and torch.equal(got["steps"], state["steps"])
    for bad, code in (("int4", grpc.StatusCode.INVALID_ARGUMENT), ("float16", grpc.StatusCode.FAILED_PRECONDITION)):
        if bad == "float16":
            reg.client.publish(2, b"not safetensors")
        with pytest.raises(grpc.RpcError) as err:
            reg.client.fetch(precision=bad)
        assert err.value.code() == code


def test_fetch_resumes_where_the_stream_broke(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    first = Running(store, chunk_size=1 << 16, largest_message=1 << 16)
    port = first.server.port
    data = weights.to_bytes(model(3.0, 400_000))  # 1.6 MB: 25 messages
    first.client.publish(1, data)
    client = ModelRegistryClient(first.server.address)
    restarted: list[Running] = []
    seen = [0]

    def break_once() -> bool:  # called after every message: restart the registry after the third
        seen[0] += 1
        if seen[0] == 3:
            first.stop()
            restarted.append(Running(store, port=port, chunk_size=1 << 16, largest_message=1 << 16))
        return False

    info, got = client.fetch(1, stop=break_once, timeout=60)
    assert got == data and info.version == 1 and seen[0] > 3
    # the resumed request started at the offset reached, on a message boundary of the new registry
    assert restarted[0].client.fetch()[1] == data
    client.close()
    restarted[0].stop()


def test_odd_offsets_and_chunk_sizes(reg: Running) -> None:
    data = bytes(range(256)) * 1000
    reg.client.publish(1, data)
    for offset, chunk_size in ((0, 0), (1 << 16, 0), (1000, 0), (5, 777), (len(data), 0)):
        got = list(reg.client.call("Fetch", pb.FetchRequest(version=1, offset=offset, chunk_size=chunk_size),
                                   timeout=30))
        assert got[0].info.version == 1
        assert b"".join(c.data for c in got) == data[offset:]
        assert all(c.offset == offset + sum(len(x.data) for x in got[:i]) for i, c in enumerate(got) if c.data)
    with pytest.raises(grpc.RpcError) as err:
        list(reg.client.call("Fetch", pb.FetchRequest(version=1, offset=len(data) + 1), timeout=30))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE


# -- watch -------------------------------------------------------------------------------------------------
def first_message(client: ModelRegistryClient, known: int, timeout: float = 2.0) -> int | None:
    stream = client.watch("probe", known)
    got: list[int] = []

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):
            got.append(next(stream).info.version)

    t = threading.Thread(target=read)
    t.start()
    t.join(timeout)
    stream.cancel()
    t.join(5)
    return got[0] if got else None


def test_watch_catches_up_from_a_known_version(reg: Running) -> None:
    assert first_message(reg.client, 0, 0.5) is None  # nothing published yet
    for v in (1, 2, 3):
        reg.client.publish(v, f"v{v}".encode())
    assert first_message(reg.client, 0) == 3  # straight to the latest, not 1, 2, 3
    assert first_message(reg.client, 1) == 3
    assert first_message(reg.client, 3, 0.5) is None  # up to date: nothing until the next version
    assert first_message(reg.client, 9) == 3  # the watcher is ahead of a reset registry: follow it


def test_watch_keepalive_repeats_the_version(tmp_path: Path) -> None:
    running = Running(LocalBlobStore(tmp_path / "blobs"), keepalive=0.2)
    try:
        running.client.publish(1, b"one")
        stream = running.client.watch("k", 0)
        got = [next(stream).info.version for _ in range(3)]
        stream.cancel()
        assert got == [1, 1, 1]
    finally:
        running.stop()


def test_watchers_swap_and_the_push_latency_is_measured(reg: Running) -> None:
    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    before = sample("overworld_registry_push_latency_seconds_count")
    like = model(0.0)
    watchers = [WeightsWatcher(reg.server.address, f"t{i}", like) for i in range(3)]
    quiet = WeightsWatcher(reg.server.address, "never-acks", like)
    try:
        deadline = time.monotonic() + 10
        while reg.client.push_status().connected_watchers < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        reg.client.publish(1, weights.to_bytes(model(1.0)))
        for w in watchers:
            got = w.wait_first(threading.Event())
            assert got is not None and got[0] == 1 and torch.equal(got[1]["w"], model(1.0)["w"])
            w.ack(1)
        deadline = time.monotonic() + 10  # an ack does not wait for its reply: wait for the three to land
        while (status := reg.client.push_status(1)).acked < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not status.complete and status.acked == 3 and status.watchers == 4
        assert dict(status.workers_per_version) == {1: 3, 0: 1}
        quiet.close()  # the one that never acknowledges leaves: the push completes without it
        status = reg.client.push_status(1, wait=10)
        assert status.complete and status.acked == 3 and status.push_seconds > 0
        assert status.last_ack_unix >= status.published_unix > 0
        assert sample("overworld_registry_push_latency_seconds_count") == before + 1
        assert REGISTRY.get_sample_value("overworld_registry_workers_per_version", {"version": "1"}) == 3
        assert sample("overworld_registry_latest_version") == 1
    finally:
        for w in watchers:
            w.close()
        quiet.close()


# -- publishing ----------------------------------------------------------------------------------------------
def slow_publish(client: ModelRegistryClient, version: int, data: bytes, sent: bytes, gate: threading.Event,
                 errors: list[grpc.RpcError]) -> threading.Thread:
    """Publish `sent` (claiming to be `data`) in two halves, the second once `gate` is set."""
    manifest = pb.VersionInfo(version=version, size_bytes=len(data))

    def messages() -> Iterator[pb.PublishRequest]:
        yield pb.PublishRequest(manifest=manifest)
        half = len(sent) // 2
        yield pb.PublishRequest(chunk=sent[:half])
        gate.wait(10)
        yield pb.PublishRequest(chunk=sent[half:])
        yield pb.PublishRequest(sha256=hashlib.sha256(data).hexdigest())

    def run() -> None:
        try:
            client.call("Publish", messages(), timeout=30)
        except grpc.RpcError as err:
            errors.append(err)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_cut_through_streams_a_version_while_it_arrives(tmp_path: Path) -> None:
    running = Running(LocalBlobStore(tmp_path / "blobs"), chunk_size=1 << 16, cut_through=True, relay_fanout=0)
    client = running.client
    try:
        good = weights.to_bytes(model(2.0, 200_000))
        client.publish(1, weights.to_bytes(model(1.0, 200_000)))
        watcher = WeightsWatcher(running.server.address, "ct", model(0.0, 200_000), verify=True)
        assert watcher.wait_first(threading.Event())[0] == 1  # type: ignore[index]
        # a corrupted publish: announced at once and streamed, then refused; the watcher never swaps it
        bad = bytearray(good)
        bad[-3] ^= 0xFF
        gate, errors = threading.Event(), []
        publisher = slow_publish(client, 2, good, bytes(bad), gate, errors)
        deadline = time.monotonic() + 10
        while watcher.announced < 2 and time.monotonic() < deadline:  # announced when the manifest is in
            time.sleep(0.01)
        stream = client._fetch(pb.FetchRequest(version=2), timeout=30)
        first, second = next(stream), next(stream)  # info, then bytes before the publish is complete
        assert first.info is not None and first.info.version == 2 and second.offset == 0 and len(second.data)
        assert first.info.sha256 == ""  # not known before the publish ends
        assert client.list_versions()[-1].version == 1  # announced, not listed
        gate.set()
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        publisher.join(10)
        assert errors and errors[0].code() == grpc.StatusCode.DATA_LOSS
        assert [v.version for v in client.list_versions()] == [1]
        assert not (tmp_path / "blobs" / weights_key(2)).exists()
        time.sleep(0.3)
        assert watcher.take() is None and watcher.version == 1
        # the same version published again, correctly: announced again, and swapped in (the watcher
        # checks the sha256 that ends the stream)
        gate, errors = threading.Event(), []
        publisher = slow_publish(client, 2, good, good, gate, errors)
        deadline = time.monotonic() + 10  # the watcher announced 2 already: the registry says when it is in
        while running.service._inflight is None and time.monotonic() < deadline:
            time.sleep(0.01)
        stream = client._fetch(pb.FetchRequest(version=2), timeout=30)
        assert next(stream).info.sha256 == ""
        gate.set()
        publisher.join(10)
        assert not errors
        last = list(stream)[-1]
        assert last.info is not None and last.info.sha256 == hashlib.sha256(good).hexdigest() and not len(last.data)
        deadline = time.monotonic() + 10
        while (got := watcher.take()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert got is not None and got[0] == 2 and torch.equal(got[1]["w"], model(2.0, 200_000)["w"])
        watcher.close()
    finally:
        running.stop()


def test_a_publisher_that_goes_away_stores_nothing(reg: Running) -> None:
    data = b"x" * 300_000
    manifest = pb.VersionInfo(version=1, size_bytes=len(data))
    gate = threading.Event()

    def messages() -> Iterator[pb.PublishRequest]:
        yield pb.PublishRequest(manifest=manifest)
        yield pb.PublishRequest(chunk=data[:1000])
        gate.wait(10)

    publisher = ModelRegistryClient(reg.server.address)
    errors: list[grpc.RpcError] = []

    def publish() -> None:
        try:
            publisher.call("Publish", messages(), timeout=30)
        except grpc.RpcError as err:
            errors.append(err)

    thread = threading.Thread(target=publish)
    thread.start()
    time.sleep(0.3)
    publisher.close()  # the publisher goes away: its call is cancelled
    gate.set()
    thread.join(10)
    assert [err.code() for err in errors] == [grpc.StatusCode.CANCELLED]
    time.sleep(0.3)
    assert reg.client.list_versions() == []
    assert reg.client.publish(1, data).version == 1  # the registry is not stuck on the broken publish


def test_tags_retention_and_restart(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    running = Running(store, retain=2)
    client = running.client
    for v in range(1, 4):
        client.publish(v, f"v{v}".encode(), tags=["reference"] if v == 1 else [])
    client.set_tag("best", 3)
    client.set_tag("exp-a.1", 2)
    client.remove_tag("exp-a.1")
    client.publish(4, b"v4")  # 2 goes: neither among the last 2 nor tagged any more
    client.set_tag("best", 4)  # moves: 3 is no longer protected
    client.publish(5, b"v5")
    for bad in ("latest", "", "has space", "x" * 80):
        with pytest.raises(grpc.RpcError) as err:
            client.set_tag(bad, 1)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.publish(6, b"v6")
    listed = {v.version: list(v.tags) for v in client.list_versions()}
    assert listed == {1: ["reference"], 4: ["best"], 5: [], 6: ["latest"]}
    with pytest.raises(grpc.RpcError) as err:
        client.fetch(version=2)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    running.stop()
    store.put(weights_key(9), b"orphan: weights without a manifest")  # an interrupted publish
    running = Running(store, retain=2)
    assert {v.version: list(v.tags) for v in running.client.list_versions()} == listed
    assert json.loads(store.get("models/tags.json")) == {"best": 4, "reference": 1}
    assert not (tmp_path / "blobs" / weights_key(9)).exists()
    assert running.client.fetch(tag="best")[1] == b"v4"
    running.client.publish(7, b"v7", parent=6)  # versions go on from where they were
    running.stop()


def test_corrupted_stored_weights_are_data_loss(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    running = Running(store)
    running.client.publish(1, b"good weights")
    running.stop()
    store.put(weights_key(1), b"evil weights")
    running = Running(store)
    with pytest.raises(grpc.RpcError) as err:
        running.client.fetch()
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    running.stop()


def test_a_fetch_asked_to_stop_gives_up(reg: Running) -> None:
    reg.client.publish(1, b"a" * 1000)
    with pytest.raises(FetchBroken):
        reg.client.fetch(1, stop=lambda: True)
    assert reg.client.fetch(1)[1] == b"a" * 1000


# -- S3 ---------------------------------------------------------------------------------------------------
def test_registry_on_s3(s3_env: dict[str, str]) -> None:
    url = f"s3://registry-test/run-{time.monotonic_ns()}"
    running = Running(open_blob_store(url), retain=2)
    data = weights.to_bytes(model(5.0))
    for v in (1, 2, 3):
        running.client.publish(v, data if v == 3 else f"v{v}".encode(), tags=["reference"] if v == 1 else [])
    running.client.set_tag("best", 2)
    running.stop()
    running = Running(open_blob_store(url), retain=2)
    try:
        assert {v.version: list(v.tags) for v in running.client.list_versions()} == {
            1: ["reference"], 2: ["best"], 3: ["latest"]}
        assert running.client.fetch()[1] == data
        assert running.client.fetch(tag="reference")[1] == b"v1"
        running.client.publish(4, b"v4")
        assert [v.version for v in running.client.list_versions()] == [1, 2, 3, 4]
        running.client.publish(5, b"v5")
        assert [v.version for v in running.client.list_versions()] == [1, 2, 4, 5]  # 3 dropped, tags kept
    finally:
        running.stop()


def test_messages_end_at_tensor_boundaries_so_tensors_arrive_as_views(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"a_big": torch.rand(100_000), "b_small": torch.rand(10), "c_small": torch.rand(3).double(),
             "d_huge": torch.rand(300_000)}
    data = weights.to_bytes(state)
    header, start = safetensors_format.read_header(data)
    ends = {start + m["data_offsets"][1] for k, m in header.items() if k != "__metadata__"}
    bounds = message_bounds(data, len(data), 1 << 16, 1 << 20)
    assert bounds is not None and bounds[-1] == len(data)
    huge = start + header["d_huge"]["data_offsets"][0]
    assert all(b in ends or (b > huge and (b - huge) % (1 << 20) == 0) for b in bounds)  # huge: split every 1 MB
    assert message_bounds(b"\x00" * 10, 1000, 64, 256) == list(range(64, 1000, 64)) + [1000]  # not safetensors
    running = Running(LocalBlobStore(tmp_path / "blobs"), chunk_size=1 << 16, largest_message=1 << 20)
    try:
        running.client.publish(1, data)
        received: list[list[tuple[int, memoryview]]] = []
        from_pieces = weights.from_pieces

        def spy(pieces: list[tuple[int, memoryview]], like: dict | None = None) -> dict[str, torch.Tensor]:
            received.append(pieces)  # the messages as they arrived
            return from_pieces(pieces, like)

        monkeypatch.setattr(weights, "from_pieces", spy)
        info, got = running.client.fetch_state(1)
        (pieces,) = received
        for k, v in state.items():
            assert torch.equal(got[k], v) and got[k].dtype == v.dtype
        spans = [(np.frombuffer(view, np.uint8).ctypes.data, len(view)) for _, view in pieces]
        ptr = got["a_big"].data_ptr()
        assert any(base <= ptr < base + n for base, n in spans)  # a view into a received message
        assert ptr % 16 == 0  # aligned: the chunk header is padded
        ptr = got["d_huge"].data_ptr()  # split over two messages: assembled
        assert not any(base <= ptr < base + n for base, n in spans)
    finally:
        running.stop()


def test_payload_accepts_any_piece_sizes() -> None:
    data = weights.to_bytes({"x": torch.rand(50_000), "y": torch.rand(7)})
    for piece in (1, 7, 4096, 65_536, len(data)):
        payload = Payload(pb.VersionInfo(version=1, size_bytes=len(data)), chunk_size=1 << 14, largest=1 << 20)
        for i in range(0, len(data), piece):
            payload.feed(data[i:i + piece])
        assert payload.data() == data and len(payload.messages) == len(payload.bounds or [])
        for message, begin in zip(payload.messages, payload.starts, strict=True):
            chunk = pb.WeightsChunk.FromString(message)  # what a client built from the generated stubs reads
            assert chunk.offset == begin and chunk.data == data[begin:begin + len(chunk.data)]
