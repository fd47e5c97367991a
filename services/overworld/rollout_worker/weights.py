"""Keeps a watch stream open on the model-registry and fetches each new version in the background.

The worker's loop calls `take()` between two inference batches; it never waits on the registry
except for the very first version.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import grpc
import torch

from overworld.core import weights
from overworld.model_registry.client import ModelRegistryClient
from overworld.v1 import model_registry_pb2 as pb

log = logging.getLogger("overworld.rollout_worker.weights")


class WeightsWatcher:
    def __init__(self, address: str, watcher_id: str, like: dict[str, torch.Tensor]) -> None:
        self.client = ModelRegistryClient(address)
        self.watcher_id = watcher_id
        self.like = like
        self.version = 0
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = 0.1
        while not self._stop.is_set():
            try:
                stream = self.client.stub.Watch(pb.WatchRequest(watcher_id=self.watcher_id, known_version=self.version))
                for info in stream:
                    if self._stop.is_set():
                        stream.cancel()
                        return
                    if info.version <= self.version:
                        continue
                    fetched, data = self.client.fetch(version=info.version)
                    state = weights.from_bytes(data, self.like)
                    with self._cond:
                        self._pending = (fetched.version, state)
                        self.version = fetched.version
                        self._cond.notify_all()
                    delay = 0.1
            except grpc.RpcError as err:
                if self._stop.is_set():
                    return
                log.warning("model registry watch broke (%s); reconnecting in %.1fs", err.code().name, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def take(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self._cond:
            pending, self._pending = self._pending, None
            return pending

    def wait_first(self, stop: threading.Event) -> tuple[int, dict[str, torch.Tensor]] | None:
        """Block until the first version arrives (the trainer publishes its initial weights)."""
        started = time.monotonic()
        with self._cond:
            while self._pending is None and not stop.is_set():
                self._cond.wait(1.0)
                if time.monotonic() - started > 30 and int(time.monotonic() - started) % 30 == 0:
                    log.info("still waiting for the trainer to publish the first model version")
        return self.take()

    def ack(self, version: int) -> None:
        with contextlib.suppress(grpc.RpcError):
            self.client.stub.AckVersion(pb.AckVersionRequest(watcher_id=self.watcher_id, version=version), timeout=5)

    def close(self) -> None:
        self._stop.set()
        self.client.close()
        self._thread.join(2)
