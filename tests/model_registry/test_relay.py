"""The weights relay in one process, over real sockets: watchers that serve what they receive on
their own RolloutWorker port (FetchWeights), a registry that plans the stripes. What a version costs
the registry, what watchers end up with when a relay lies, half precision, a registry restart.
(Processes, mutual TLS, shaped links and a relay killed mid-push: tests/cluster/test_relay_links.py.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from overworld.core import weights
from overworld.core.blobs import LocalBlobStore
from overworld.core.grpc_util import Server, serve
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.relay import RelayShelf, serve_relayed
from overworld.model_registry.server import ModelRegistryService, registration
from overworld.model_registry.watcher import WeightsWatcher
from overworld.rollout_worker.service import WorkerService, add_to_server
from overworld.v1 import model_registry_pb2 as pb


def model(value: float) -> dict[str, torch.Tensor]:
    """~1.3 MB: a tensor larger than a relay message (split across messages), small ones, an int."""
    return {"big": torch.full((300_000,), value) + torch.arange(300_000) / 7,
            "small": torch.full((100,), -value), "steps": torch.tensor([int(value)])}


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Registry:
    def __init__(self, root: Path, port: int = 0, relay_fanout: int = 2) -> None:
        self.service = ModelRegistryService(LocalBlobStore(root), relay_fanout=relay_fanout)
        self.server: Server = serve([registration(self.service)], port=port)
        self.client = ModelRegistryClient(self.server.address)

    def stop(self) -> None:
        self.client.close()
        self.service.stop()
        self.server.stop(0)


class Watcher:
    """A rollout worker's weights path: its RolloutWorker service (the relay) and its WeightsWatcher,
    swapping in what take() returns and acknowledging it, as the worker loop does."""

    def __init__(self, registry: str, name: str, precision: str = "", service: object = None) -> None:
        self.shelf = RelayShelf()
        self.server = serve([(add_to_server, service or WorkerService(self.shelf, threading.Event()),
                              "overworld.v1.RolloutWorker")])
        self.model = {k: torch.zeros_like(v) for k, v in model(0.0).items()}
        self.watcher = WeightsWatcher(registry, name, self.model, precision=precision, relay_port=self.server.port,
                                      shelf=self.shelf)
        self.version = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.01):
            got = self.watcher.take()
            if got is not None:
                version, state = got
                for k, v in state.items():
                    self.model[k].copy_(v)
                self.version = version
                self.watcher.ack(version)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.watcher.close()
        self.server.stop(0)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    running = Registry(tmp_path / "blobs")
    yield running
    running.stop()


def publish_and_wait(registry: Registry, watchers: list[Watcher], version: int, value: float,
                     timeout: float = 60) -> float:
    """Publish (once every watcher is connected), wait for every watcher to swap it in; the registry's
    egress for it in bytes."""
    deadline = time.monotonic() + timeout

    def connected() -> int:
        try:
            return registry.client.push_status(0, timeout=5).connected_watchers
        except grpc.RpcError:  # a registry still starting
            return 0

    while connected() < len(watchers):
        assert time.monotonic() < deadline, "the watchers did not all connect"
        time.sleep(0.05)
    before = counter("overworld_registry_bytes_pushed_total")
    registry.client.publish(version, weights.to_bytes(model(value)))
    status = registry.client.push_status(version, wait=timeout)
    assert status.complete and status.acked == len(watchers), status
    assert len(status.ack_seconds) == status.acked and max(status.ack_seconds) == pytest.approx(status.push_seconds)
    deadline = time.monotonic() + 10
    while any(w.version != version for w in watchers) and time.monotonic() < deadline:
        time.sleep(0.02)
    return counter("overworld_registry_bytes_pushed_total") - before


def assert_holds(watcher: Watcher, value: float, precision: str = "") -> None:
    expected = model(value)
    for k, v in expected.items():
        if precision and v.is_floating_point():
            v = v.to(weights.half_dtype(precision)).to(v.dtype)
        assert torch.equal(watcher.model[k], v), (k, watcher.watcher.watcher_id)


def test_relayed_versions_cost_the_registry_one_copy_and_survive_its_restart(registry: Registry,
                                                                               tmp_path: Path) -> None:
    watchers = [Watcher(registry.server.address, f"w{i}") for i in range(6)]
    try:
        size = len(weights.to_bytes(model(1.0)))
        served = counter("overworld_relay_bytes_served_total")
        for version in (1, 2, 3):
            egress = publish_and_wait(registry, watchers, version, float(version))
            # one copy (stripe boundaries and message headers aside), not one per watcher
            assert egress <= 1.05 * size, (egress, size)
            for w in watchers:
                assert_holds(w, float(version))
        assert counter("overworld_relay_bytes_served_total") - served >= 4 * size  # the rest came from peers

        # the registry restarts on the same port: the watchers reconnect, the next version is relayed too
        port = registry.server.port
        registry.stop()
        restarted = Registry(tmp_path / "blobs", port=port)
        try:
            egress = publish_and_wait(restarted, watchers, 4, 4.0)
            assert egress <= 1.05 * size
            for w in watchers:
                assert_holds(w, 4.0)
        finally:
            restarted.stop()
    finally:
        for w in watchers:
            w.close()


def test_the_star_costs_a_copy_per_watcher(tmp_path: Path) -> None:
    """The same push with relay_fanout 0, for contrast (and so that the test above can fail)."""
    star = Registry(tmp_path / "star", relay_fanout=0)
    watchers = [Watcher(star.server.address, f"s{i}") for i in range(4)]
    try:
        size = len(weights.to_bytes(model(1.0)))
        assert publish_and_wait(star, watchers, 1, 1.0) >= 4 * size
    finally:
        for w in watchers:
            w.close()
        star.stop()


class LyingRelay(WorkerService):
    """Relays what it holds with one byte of every message flipped."""

    def fetch_weights(self, request: pb.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        for i, message in enumerate(serve_relayed(self.shelf, request, context)):
            yield message if i == 0 else message[:-1] + bytes([message[-1] ^ 0xFF])


def test_a_relay_that_passes_on_wrong_bytes_costs_its_children_a_fetch_never_a_wrong_version(
        registry: Registry) -> None:
    honest = [Watcher(registry.server.address, f"h{i}") for i in range(2)]
    liar_shelf = RelayShelf()
    liar = Watcher(registry.server.address, "liar", service=LyingRelay(liar_shelf, threading.Event()))
    liar.watcher.shelf = liar.shelf = liar_shelf
    late = [Watcher(registry.server.address, f"l{i}") for i in range(3)]
    watchers = [*honest, liar, *late]
    try:
        refetches = counter("overworld_relay_refetches_total")
        for version in (1, 2):
            publish_and_wait(registry, watchers, version, float(version))
            for w in watchers:
                assert_holds(w, float(version))
        # the liar is interior in one stripe tree: its children saw the mismatch and refetched
        assert counter("overworld_relay_refetches_total") > refetches
    finally:
        for w in watchers:
            w.close()


def test_half_precision_watchers_relay_among_themselves(registry: Registry) -> None:
    watchers = [Watcher(registry.server.address, f"b{i}", precision="bfloat16") for i in range(3)]
    watchers += [Watcher(registry.server.address, f"f{i}") for i in range(2)]
    try:
        publish_and_wait(registry, watchers, 1, 1.25)
        for w in watchers[:3]:
            assert_holds(w, 1.25, "bfloat16")
        for w in watchers[3:]:
            assert_holds(w, 1.25)
    finally:
        for w in watchers:
            w.close()


def test_a_relay_answers_bad_requests_with_a_status(registry: Registry) -> None:
    watchers = [Watcher(registry.server.address, f"v{i}") for i in range(2)]
    try:
        publish_and_wait(registry, watchers, 1, 1.0)
        from overworld.core.grpc_util import channel
        from overworld.v1 import rollout_worker_pb2_grpc

        held = watchers[0].shelf.get(1, 0, lambda: True)
        assert held is not None
        with channel(f"127.0.0.1:{watchers[0].server.port}") as ch:
            stub = rollout_worker_pb2_grpc.RolloutWorkerStub(ch)
            cases = {
                "no version": (pb.FetchRequest(version=0, chunk_size=held.chunk), grpc.StatusCode.INVALID_ARGUMENT),
                "by tag": (pb.FetchRequest(version=1, tag="best", chunk_size=held.chunk),
                           grpc.StatusCode.INVALID_ARGUMENT),
                "other precision": (pb.FetchRequest(version=1, chunk_size=held.chunk, precision="bfloat16"),
                                    grpc.StatusCode.FAILED_PRECONDITION),
                "other chunk size": (pb.FetchRequest(version=1, chunk_size=1000), grpc.StatusCode.FAILED_PRECONDITION),
                "odd offset": (pb.FetchRequest(version=1, chunk_size=held.chunk, offset=3), grpc.StatusCode.OUT_OF_RANGE),
                "past the end": (pb.FetchRequest(version=1, chunk_size=held.chunk, limit=held.size + 1),
                                 grpc.StatusCode.OUT_OF_RANGE),
            }
            for what, (request, code) in cases.items():
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.FetchWeights(request, timeout=5))
                assert err.value.code() == code, what
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:  # a version it will never hold: not forever
                list(stub.FetchWeights(pb.FetchRequest(version=99, chunk_size=held.chunk), timeout=30))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() - started < 20
            whole = list(stub.FetchWeights(pb.FetchRequest(version=1, chunk_size=held.chunk), timeout=10))
            assert b"".join(c.data for c in whole) == weights.to_bytes(model(1.0))
    finally:
        for w in watchers:
            w.close()
