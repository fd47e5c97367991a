"""The push path with real processes: a registry process (`python -m overworld.model_registry`) and
8 watcher processes, each running the rollout worker's WeightsWatcher and writing every version it
swaps in to a file (and acknowledging it, as the worker does)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from overworld.core.wire.weights import to_bytes
from overworld.model_registry.client import ModelRegistryClient
from overworld.v1 import model_registry_pb2 as pb
from tests.support import free_port, stop_process, wait_port

ROOT = Path(__file__).resolve().parents[2]
WATCHERS = 8

# One watcher process: swaps in what take() returns (between two "batches" of 10 ms), records
# "version checksum" for each swap, and acknowledges it.
WATCHER = """
import sys, time, torch
from overworld.model_registry.worker.watcher import WeightsWatcher
address, watcher_id, out = sys.argv[1:4]
model = {"w": torch.zeros(4096), "b": torch.zeros(16, dtype=torch.float64)}
watcher = WeightsWatcher(address, watcher_id, model)
while True:
    got = watcher.take()
    if got is not None:
        version, state = got
        for k, v in state.items():
            model[k].copy_(v)
        with open(out, "a") as f:
            f.write(f"{version} {float(model['w'].sum()):.3f} {model['b'].dtype}\\n")
        watcher.ack(version)
    time.sleep(0.01)
"""


def weights_of(version: int) -> bytes:
    return to_bytes({"w": torch.full((4096,), float(version)), "b": torch.full((16,), float(version), dtype=torch.float64)})


def env() -> dict[str, str]:
    out = {**os.environ, "PYTHONPATH": str(ROOT / "services"), "OVERWORLD_LOG_FORMAT": "text",
           "no_proxy": "127.0.0.1,localhost"}
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        out.pop(var, None)
    return out


class Registry:
    def __init__(self, blobs: Path) -> None:
        self.blobs = blobs
        self.port, self.metrics_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "overworld.model_registry", "--port", str(self.port), "--blobs", str(self.blobs),
             "--metrics-port", str(self.metrics_port)], env=env())
        wait_port(self.port)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line == name:
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_for(what: str, check: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def swaps(path: Path) -> list[tuple[int, float, str]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        version, total, dtype = line.split()
        out.append((int(version), float(total), dtype))
    return out


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Registry, list[subprocess.Popen], Callable[[int], subprocess.Popen]]]:
    registry = Registry(tmp_path / "blobs")
    registry.start()
    procs: list[subprocess.Popen] = []

    def start_watcher(i: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", WATCHER, registry.address, f"w{i}", str(tmp_path / f"w{i}.log")],
                                env=env())
        procs.append(proc)
        return proc

    try:
        yield registry, procs, start_watcher
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        registry.stop()


def test_eight_watcher_processes_follow_every_push(fleet, tmp_path: Path) -> None:
    registry, procs, start_watcher = fleet
    watchers = [start_watcher(i) for i in range(WATCHERS)]
    client = ModelRegistryClient(registry.address)
    wait_for("8 watchers connected", lambda: client.push_status(timeout=5).connected_watchers == WATCHERS, 60)
    logs = [tmp_path / f"w{i}.log" for i in range(WATCHERS)]

    # five versions back to back: the publisher never waits for the watchers
    started = time.monotonic()
    for version in range(1, 6):
        client.publish(version, weights_of(version), parent=version - 1)
        if version == 2:  # a watcher dies mid-stream
            watchers[3].send_signal(signal.SIGKILL)
            watchers[3].wait()
    publishing = time.monotonic() - started
    wait_for("every live watcher on version 5",
             lambda: all(swaps(log)[-1:] == [(5, 5 * 4096, "torch.float64")] for i, log in enumerate(logs) if i != 3))
    for i, log in enumerate(logs):
        versions = [v for v, _, _ in swaps(log)]
        assert versions == sorted(set(versions)), f"w{i} swapped {versions}"  # only forward, never twice
        assert all(total == v * 4096 for v, total, _ in swaps(log))  # the weights of the version it names
    assert publishing < 30

    # the killed watcher comes back with nothing and catches up to the latest at once
    before = len(swaps(logs[3]))
    start_watcher(3)
    wait_for("w3 back on version 5", lambda: swaps(logs[3])[-1:] == [(5, 5 * 4096, "torch.float64")])
    assert [v for v, _, _ in swaps(logs[3])[before:]] == [5]  # no replay of the versions it missed

    # push latency: publish -> last watcher acknowledged, from the acknowledgements
    status = client.push_status(5, wait=30)
    assert status.complete and status.acked == WATCHERS - 1  # w3 was dead (or left without acknowledging)
    assert status.push_seconds > 0
    client.publish(6, weights_of(6), parent=5)
    status = client.push_status(6, wait=30)
    assert status.complete and status.acked == WATCHERS and 0 < status.push_seconds < 30
    assert dict(status.workers_per_version) == {6: WATCHERS}
    text = registry.metrics()
    assert (metric(text, "overworld_registry_push_latency_seconds_count") or 0) >= 2
    assert metric(text, "overworld_registry_latest_version") == 6
    assert metric(text, 'overworld_registry_workers_per_version{version="6"}') == WATCHERS
    assert metric(text, "overworld_registry_watchers") == WATCHERS
    assert (metric(text, "overworld_registry_bytes_pushed_total") or 0) >= WATCHERS * len(weights_of(6))

    # the registry restarts (killed): it keeps its versions, and every watcher reconnects and goes on
    registry.kill()
    registry.start()
    assert [v.version for v in client.list_versions(timeout=30)] == [1, 2, 3, 4, 5, 6]
    wait_for("watchers reconnected", lambda: client.push_status(timeout=5).connected_watchers == WATCHERS, 30)
    client.publish(7, weights_of(7), parent=6)
    status = client.push_status(7, wait=30)
    assert status.complete and status.acked == WATCHERS
    for i, log in enumerate(logs):
        versions = [v for v, _, _ in swaps(log)]
        assert versions[-2:] == [6, 7], f"w{i}: {versions}"  # nothing fetched again after the restart

    # a corrupted chunk is refused while the watchers listen: nothing stored, nobody swaps
    good = weights_of(8)
    bad = bytearray(good)
    bad[-5] ^= 0xFF
    manifest = pb.VersionInfo(version=8, size_bytes=len(good))
    with pytest.raises(grpc.RpcError) as err:
        client.call("Publish", iter([pb.PublishRequest(manifest=manifest), pb.PublishRequest(chunk=bytes(bad)),
                                     pb.PublishRequest(sha256=hashlib.sha256(good).hexdigest())]), timeout=60)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert [v.version for v in client.list_versions()][-1] == 7
    assert not list((tmp_path / "blobs" / "models").glob("0000000008*"))
    time.sleep(0.5)
    assert all(swaps(log)[-1][0] == 7 for log in logs)
    assert not any(p.poll() is not None for p in procs if p is not watchers[3])
    client.close()
