"""The weights relay in one process, over real sockets: watchers that serve what they receive on their
own weights-stream port, a registry that plans the stripes. What a version costs the registry, a relay
that lies (caught at its hop, chunk by chunk, and left out of the next plans), one that sends
keep-alives but no data, half precision, a registry restart. (Processes, mutual TLS, shaped links and a
relay killed mid-push: tests/rehearsal/test_relay_links.py; the stream's authorization: tests/security.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from prometheus_client import REGISTRY

from overworld.core.blobs.store import LocalBlobStore
from overworld.core.grpc_util import Server, serve
from overworld.core.security import authz
from overworld.core.wire import weights
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.relay_plan import relay_chunk_bytes
from overworld.model_registry.server import ModelRegistryService, registration
from overworld.model_registry.stream.protocol import FrameWriter, StreamError, open_stream
from overworld.model_registry.stream.server import WeightsStreamServer
from overworld.model_registry.worker import relay
from overworld.model_registry.worker.relay import RelayShelf, serve_relay, serve_relayed
from overworld.model_registry.worker.watcher import WeightsWatcher
from overworld.v1 import model_registry_pb2 as pb


def model(value: float) -> dict[str, torch.Tensor]:
    """~4.8 MB: a tensor of many relay chunks (10 in all), small ones, an int."""
    return {"big": torch.full((1_200_000,), value) + torch.arange(1_200_000) / 7,
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


Relay = Callable[[RelayShelf], WeightsStreamServer]


class Watcher:
    """A rollout worker's weights path: its relay (the weights stream over its shelf) and its
    WeightsWatcher, swapping in what take() returns and acknowledging it, as the worker loop does."""

    def __init__(self, registry: str, name: str, precision: str = "", relay: Relay = serve_relay) -> None:
        self.shelf = RelayShelf()
        self.server = relay(self.shelf)
        self.address = f"127.0.0.1:{self.server.port}"
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
        self.server.stop()


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


class _LastChunkFlipped:
    """A writer that passes on what it is given, but for one byte of the last chunk asked for."""

    def __init__(self, writer: FrameWriter, last: int) -> None:
        self.writer, self.last = writer, last

    def data(self, index: int, chunk: memoryview) -> None:
        if index == self.last:
            chunk = memoryview(bytes(chunk[:-1]) + bytes([chunk[-1] ^ 0xFF]))
        self.writer.data(index, chunk)

    def keepalive(self) -> None:
        self.writer.keepalive()


def lying_relay(shelf: RelayShelf) -> WeightsStreamServer:
    """A relay that changes one byte of the last chunk of every stripe it passes on."""
    def handler(request: pb.FetchRequest, writer: FrameWriter, active: Callable[[], bool]) -> None:
        chunk = request.chunk_size or 1
        last = (request.offset + request.limit + chunk - 1) // chunk - 1
        serve_relayed(shelf, request, _LastChunkFlipped(writer, last), active)  # type: ignore[arg-type]

    return WeightsStreamServer(authz.WEIGHTS_FROM_RELAY, handler)


def keepalive_only_relay(shelf: RelayShelf) -> WeightsStreamServer:
    """A relay that says it lives and never sends a chunk (a wedged pod whose heartbeat thread runs)."""
    def handler(request: pb.FetchRequest, writer: FrameWriter, active: Callable[[], bool]) -> None:
        while active():
            writer.keepalive()
            time.sleep(0.2)

    return WeightsStreamServer(authz.WEIGHTS_FROM_RELAY, handler)


def test_a_lying_relay_is_caught_at_its_hop_costs_only_its_bad_chunks_and_is_left_out_of_the_next_plans(
        registry: Registry) -> None:
    """The liar (interior in one stripe tree) changes the last chunk of each stripe it passes on. Its
    children check every chunk against the registry's hash: they fetch that one chunk from the registry
    (not the whole version), never pass the bad one on, and report the liar, which then relays nothing
    in the next version's plan."""
    honest = [Watcher(registry.server.address, f"h{i}") for i in range(2)]
    liar = Watcher(registry.server.address, "liar", relay=lying_relay)
    late = [Watcher(registry.server.address, f"l{i}") for i in range(3)]
    watchers = [*honest, liar, *late]
    try:
        size = len(weights.to_bytes(model(1.0)))
        bad = counter("overworld_relay_bad_chunks_total")
        excluded = counter("overworld_registry_relays_excluded_total", reason="lied")
        egress = publish_and_wait(registry, watchers, 1, 1.0)
        for w in watchers:
            assert_holds(w, 1.0)
        plan = registry.service._plans[(1, "")]
        children = plan.children(liar.address)
        assert children >= 1, "the liar must be a parent in the first plan for this test to mean anything"
        assert counter("overworld_relay_bad_chunks_total") - bad == children  # caught at the liar's own hop
        chunk = relay_chunk_bytes(size)
        # one copy, and for each of the liar's children only the chunk it changed
        assert egress <= 1.05 * size + children * chunk, (egress, size, children)
        # reported with the acknowledgements: the liar relays none of the next version
        deadline = time.monotonic() + 10
        while counter("overworld_registry_relays_excluded_total", reason="lied") == excluded:
            assert time.monotonic() < deadline, "the liar was not reported"
            time.sleep(0.02)
        bad = counter("overworld_relay_bad_chunks_total")
        publish_and_wait(registry, watchers, 2, 2.0)
        assert registry.service._plans[(2, "")].children(liar.address) == 0
        assert counter("overworld_relay_bad_chunks_total") == bad
        for w in watchers:
            assert_holds(w, 2.0)
    finally:
        for w in watchers:
            w.close()


def test_a_relay_that_sends_keepalives_but_no_data_is_given_up_as_stalled(
        registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay, "STALL_SECONDS", 1.0)
    monkeypatch.setattr(relay, "DATA_STALL_SECONDS", 2.0)
    wedged = Watcher(registry.server.address, "wedged", relay=keepalive_only_relay)
    others = [Watcher(registry.server.address, f"o{i}") for i in range(3)]
    watchers = [wedged, *others]
    try:
        stalled = counter("overworld_relay_reattaches_total", reason="stalled")
        excluded = counter("overworld_registry_relays_excluded_total", reason="stalled")
        # the push completes (wedged is a root: its children go on from the registry after the data stall
        # time, where without the data watchdog they would wait out the fetch's deadline of 120 s)
        publish_and_wait(registry, watchers, 1, 1.0, timeout=60)
        assert registry.service._plans[(1, "")].children(wedged.address) >= 1
        for w in watchers:
            assert_holds(w, 1.0)
        assert counter("overworld_relay_reattaches_total", reason="stalled") > stalled
        deadline = time.monotonic() + 10
        while counter("overworld_registry_relays_excluded_total", reason="stalled") == excluded:
            assert time.monotonic() < deadline, "the stalled relay was not reported"
            time.sleep(0.02)
        publish_and_wait(registry, watchers, 2, 2.0, timeout=60)
        assert registry.service._plans[(2, "")].children(wedged.address) == 0
    finally:
        for w in watchers:
            w.close()


def connect_in_order(registry: Registry, *specs: tuple[str, Relay]) -> list[Watcher]:
    """Watchers connected one after the other, so that the plans place them in this order (the first is
    the root of stripe 0's tree, the third and fifth its children, and so on)."""
    watchers: list[Watcher] = []
    for name, serve_it in specs:
        watchers.append(Watcher(registry.server.address, name, relay=serve_it))
        deadline = time.monotonic() + 10
        while registry.client.push_status(0, timeout=5).connected_watchers < len(watchers):
            assert time.monotonic() < deadline, f"{name} did not connect"
            time.sleep(0.02)
    return watchers


@pytest.mark.parametrize("run", range(3))
def test_a_keepalive_only_relay_is_blamed_and_its_honest_descendants_are_not(
        registry: Registry, monkeypatch: pytest.MonkeyPatch, run: int) -> None:
    """The production ratio of clocks, shortened (stall 1 s, keep-alive a third of it, data stall twice it):
    the wedged root of stripe 0 holds its children, which hold theirs. Each level gives its source one
    more data stall time than the level above gives its own (the announcement's depths), so the honest
    children re-attach to the registry before their own children give up on them: exactly the wedged
    relay is excluded (three runs: once was not enough to show it before)."""
    monkeypatch.setattr(relay, "STALL_SECONDS", 1.0)
    monkeypatch.setattr(relay, "KEEPALIVE_SECONDS", 1.0 / 3)
    monkeypatch.setattr(relay, "DATA_STALL_SECONDS", 2.0)
    watchers = connect_in_order(registry, ("wedged", keepalive_only_relay),
                                *[(f"h{i}", serve_relay) for i in range(8)])
    try:
        publish_and_wait(registry, watchers, 1, 1.0, timeout=60)
        plan = registry.service._plans[(1, "")]
        wedged = watchers[0].address
        deep = [w for w in watchers if plan.depth_of(0, w.address) == 3]
        assert plan.depth_of(0, wedged) == 1 and deep, "the plan must put honest relays under the wedged one"
        for w in watchers:
            assert_holds(w, 1.0)
        time.sleep(0.5)  # the last acknowledgements (they carry the faults)
        assert registry.service._exclusions.excluded() == {"wedged"}
    finally:
        for w in watchers:
            w.close()


def test_a_fault_is_taken_only_from_a_child_of_that_relay(registry: Registry) -> None:
    """A worker reporting a relay it was not given (to turn the fleet back into the star, say) changes
    nothing; a child's report excludes the relay, by the watcher id the registry knows."""
    watchers = connect_in_order(registry, *[(f"w{i}", serve_relay) for i in range(4)])
    try:
        publish_and_wait(registry, watchers, 1, 1.0)
        plan = registry.service._plans[(1, "")]
        parent = next(w for w in watchers if plan.children(w.address))
        child = next(w for w in watchers if plan.is_source_of(parent.address, w.watcher.watcher_id))
        stranger = next(w for w in watchers if w is not parent and not plan.is_source_of(parent.address,
                                                                                         w.watcher.watcher_id))

        def report(reporter: str) -> None:
            registry.client.ack(reporter, 1, [pb.RelayFault(relay=parent.address, reason="lied", version=1)]).result(5)

        report(stranger.watcher.watcher_id)
        report("not-a-watcher")
        assert registry.service._exclusions.excluded() == set()
        report(child.watcher.watcher_id)
        assert registry.service._exclusions.excluded() == {parent.watcher.watcher_id}
    finally:
        for w in watchers:
            w.close()


class _CorruptedOnTheWire:
    """A relay's socket that flips a byte of each large sealed frame as it leaves: a tag that fails."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def sendmsg(self, views: list[Any]) -> int:
        if sum(len(v) for v in views) > 1000:
            first = bytearray(views[-1])
            first[len(first) // 2] ^= 0x01
            views = [*views[:-1], memoryview(first)]
        return self._sock.sendmsg(views)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def corrupting_relay(shelf: RelayShelf) -> WeightsStreamServer:
    def handler(request: pb.FetchRequest, writer: FrameWriter, active: Callable[[], bool]) -> None:
        writer.sock = _CorruptedOnTheWire(writer.sock)  # type: ignore[assignment]
        serve_relayed(shelf, request, writer, active)

    return WeightsStreamServer(authz.WEIGHTS_FROM_RELAY, handler)


def test_a_relay_whose_frames_do_not_open_counts_as_a_liar(registry: Registry) -> None:
    """A bad tag (or header, or an ERROR frame) after the relay answered is the relay's doing: its children
    report it as lying, as for a chunk that does not match its hash."""
    watchers = connect_in_order(registry, ("corrupt", corrupting_relay), *[(f"h{i}", serve_relay) for i in range(4)])
    try:
        lied = counter("overworld_registry_relays_excluded_total", reason="lied")
        publish_and_wait(registry, watchers, 1, 1.0, timeout=60)
        assert registry.service._plans[(1, "")].children(watchers[0].address) >= 1
        for w in watchers:
            assert_holds(w, 1.0)
        deadline = time.monotonic() + 10
        while counter("overworld_registry_relays_excluded_total", reason="lied") == lied:
            assert time.monotonic() < deadline, "the corrupting relay was not reported"
            time.sleep(0.02)
        assert registry.service._exclusions.excluded() == {"corrupt"}
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
        held = watchers[0].shelf.get(1, 0, lambda: True)
        assert held is not None
        held.release()
        address = watchers[0].address

        def fetch(request: pb.FetchRequest) -> bytes:
            stream = open_stream(address, request, 5.0, 30.0, lambda: False, "rollout-worker")
            out = bytearray(held.size)
            try:
                while stream.next(lambda i, n: memoryview(out)[i * held.chunk:i * held.chunk + n]).kind != 3:
                    pass
            finally:
                stream.close()
            return bytes(out)

        cases = {
            "no version": (pb.FetchRequest(version=0, chunk_size=held.chunk), grpc.StatusCode.INVALID_ARGUMENT),
            "by tag": (pb.FetchRequest(version=1, tag="best", chunk_size=held.chunk), grpc.StatusCode.INVALID_ARGUMENT),
            "other precision": (pb.FetchRequest(version=1, chunk_size=held.chunk, precision="bfloat16"),
                                grpc.StatusCode.FAILED_PRECONDITION),
            "unknown precision": (pb.FetchRequest(version=1, chunk_size=held.chunk, precision="int3"),
                                  grpc.StatusCode.INVALID_ARGUMENT),
            "other chunk size": (pb.FetchRequest(version=1, chunk_size=1000), grpc.StatusCode.FAILED_PRECONDITION),
            "odd offset": (pb.FetchRequest(version=1, chunk_size=held.chunk, offset=3), grpc.StatusCode.OUT_OF_RANGE),
            "past the end": (pb.FetchRequest(version=1, chunk_size=held.chunk, limit=held.size + 1),
                             grpc.StatusCode.OUT_OF_RANGE),
        }
        for what, (request, code) in cases.items():
            with pytest.raises(StreamError) as err:
                fetch(request)
            assert err.value.code == code, (what, err.value)
        started = time.monotonic()
        with pytest.raises(StreamError) as err:  # a version it will never hold: not forever
            fetch(pb.FetchRequest(version=99, chunk_size=held.chunk))
        assert err.value.code == grpc.StatusCode.NOT_FOUND and time.monotonic() - started < 20
        assert fetch(pb.FetchRequest(version=1, chunk_size=held.chunk)) == weights.to_bytes(model(1.0))
    finally:
        for w in watchers:
            w.close()
