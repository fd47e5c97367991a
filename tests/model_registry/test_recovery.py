"""A model-registry on S3 killed with SIGKILL and started again on its address: versions and tags are
rebuilt from the blob store, a publish in flight is retried through the restart (and a version published
again with the same bytes is the same version, never a fork), and a worker's watcher resumes from the
version it holds, then swaps in the next one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from overworld.core.grpc_util import wait_healthy
from overworld.core.wire import weights
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.worker.watcher import WeightsWatcher
from tests.support import free_port


def model(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((200_000,), value)}


class RegistryProcess:
    def __init__(self, blobs: str, log: Path) -> None:
        self.blobs, self.log = blobs, log
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "overworld.model_registry", "--port", str(self.port),
                                          "--blobs", self.blobs], stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "OVERWORLD_LOG_FORMAT": "text"})
        wait_healthy(self.address, timeout=60)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.mark.slow
def test_sigkill_restart_rebuilds_versions_retries_the_publish_and_resumes_watchers(
        s3_env: dict[str, str], tmp_path: Path) -> None:
    registry = RegistryProcess(f"s3://registry-recovery/{uuid.uuid4().hex[:8]}", tmp_path / "registry.log")
    registry.start()
    client = ModelRegistryClient(registry.address)
    watcher = WeightsWatcher(registry.address, "worker-1", model(0.0))
    fetched: list[int] = []
    fetch = watcher._fetch

    def recording_fetch(announcement):  # type: ignore[no-untyped-def]
        fetched.append(announcement.info.version)
        return fetch(announcement)

    watcher._fetch = recording_fetch  # type: ignore[method-assign]
    try:
        v2 = weights.to_bytes(model(2.0))
        client.publish(1, weights.to_bytes(model(1.0)), tags=["reference"])
        client.publish(2, v2, parent=1)
        client.set_tag("best", 2)
        deadline = time.monotonic() + 60
        while watcher.version != 2:
            assert time.monotonic() < deadline, "the watcher did not get version 2"
            time.sleep(0.05)

        registry.kill()
        v3 = weights.to_bytes(model(3.0))
        published: list = []
        publisher = threading.Thread(target=lambda: published.append(client.publish(3, v3, parent=2, timeout=120)))
        publisher.start()  # UNAVAILABLE until the registry is back: retried with backoff
        time.sleep(1.0)
        registry.start()
        publisher.join(120)
        assert published and published[0].version == 3
        listed = {v.version: list(v.tags) for v in client.list_versions()}
        assert listed == {1: ["reference"], 2: ["best"], 3: ["latest"]}  # rebuilt from S3, tags included
        deadline = time.monotonic() + 60
        while watcher.version != 3:
            assert time.monotonic() < deadline, "the watcher did not resume"
            time.sleep(0.05)
        assert fetched[-1] == 3 and fetched.count(2) == 1  # resumed from 2: version 2 was not fetched again
        _, state = watcher.take()
        assert torch.equal(state["w"], model(3.0)["w"])

        # the trainer publishing 3 again (its first attempt's reply was lost) gets the same version...
        assert client.publish(3, v3, parent=2).sha256 == published[0].sha256
        # ...and never a second, different version 3
        with pytest.raises(grpc.RpcError) as err:
            client.publish(3, v2, parent=2)
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        watcher.close()
        client.close()
        if registry.proc is not None:
            registry.proc.kill()
            registry.proc.wait(10)
