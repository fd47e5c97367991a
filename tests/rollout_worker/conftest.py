"""A real rollout-manager, replay buffer and model registry on loopback sockets, for workers to join."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from overworld.core.blobs.store import BlobStore, LocalBlobStore
from overworld.core.config import load_config
from overworld.core.grpc_util import serve
from overworld.core.wire.weights import to_bytes
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.server import ModelRegistryService
from overworld.policies.factory import run_spaces
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.replay_buffer.index import MemoryIndex
from overworld.replay_buffer.leases import Leases
from overworld.replay_buffer.rate_limiter import RateLimiter
from overworld.replay_buffer.server import ReplayBufferService
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_manager.server import RolloutManagerService
from overworld.rollout_manager.state import StateStore
from overworld.v1 import (
    model_registry_pb2_grpc,
    replay_buffer_pb2,
    replay_buffer_pb2_grpc,
    rollout_manager_pb2_grpc,
)

T = 16
BASE: dict[str, Any] = {
    "run_id": "wtest", "env_kwargs": {"id": "CartPole-v1"},
    "rollout_config": {"fragment_length": T, "to_send_queue_size": 8,
                       "worker_config": {"num_envs": 4, "num_env_processes": 2, "device": "cpu"},
                       "replay_buffer_config": {"max_chunks": 100000, "max_reuse": 1, "max_staleness": 100}},
    "train_config": {"batches_per_iteration": 1, "gradient_accumulation": 1, "context_length": T}}


def merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        nested = isinstance(v, dict) and isinstance(out.get(k), dict) and k != "env_kwargs"
        out[k] = merge(out[k], v) if nested else v
    return out


class Cluster:
    """`manager_state` and `registry_blobs`: where the manager's state and the registry's versions live
    (default: the manager's in its process, the registry's in a local directory)."""

    def __init__(self, tmp_path: Path, overrides: dict, source: Path | None = None,
                 manager_state: StateStore | None = None, registry_blobs: BlobStore | None = None) -> None:
        self.config = load_config(source if source is not None else merge(BASE, overrides))
        self.manager = RolloutManagerService(self.config, lease_seconds=5.0,
                                             video_store=LocalBlobStore(tmp_path / "videos"), state=manager_state)
        self.ms = serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server, self.manager,
                          "overworld.v1.RolloutManager")])
        self.registry = ModelRegistryService(registry_blobs or LocalBlobStore(tmp_path / "registry"))
        self.rs = serve([(model_registry_pb2_grpc.add_ModelRegistryServicer_to_server, self.registry,
                          "overworld.v1.ModelRegistry")])
        rb = self.config.rollout_config.replay_buffer_config
        limiter = RateLimiter.create(rb.samples_per_insert, rb.samples_per_insert_error, rb.min_size_to_sample,
                                     rb.max_reuse)
        # As `overworld serve replay-buffer` wires it: room only for workers holding a lease at the manager.
        self.manager_client = RolloutManagerClient(self.ms.address)
        self.buffer = ReplayBufferService(MemoryIndex(rb.max_chunks, rb.max_reuse, rb.max_staleness, 1, limiter),
                                          LocalBlobStore(tmp_path / "b"), "wtest", self.config.rollout_config.fragment_length,
                                          1, rb.max_chunks, lambda: self.manager._spaces,
                                          leases=Leases(lambda: self.manager_client.leases().worker_ids, refresh=0.25),
                                          reservations=rb.reservations)
        self.bs = self._serve_buffer(0)
        self.spaces, self.policy, _, _ = run_spaces(self.config)
        self.publish(1)
        self.buffer_client = ReplayBufferClient(self.bs.address)
        self.buffer_client.set_model_version(1)
        self.addresses = (self.ms.address, self.bs.address, self.rs.address)

    def _serve_buffer(self, port: int) -> grpc.Server:
        return serve([(replay_buffer_pb2_grpc.add_ReplayBufferServicer_to_server, self.buffer,
                       "overworld.v1.ReplayBuffer")], port=port)

    def serve_buffer_again(self) -> None:
        """The replay buffer back on its address after `bs.stop` (a pod handing over), its state kept."""
        self.bs = self._serve_buffer(int(self.addresses[1].rsplit(":", 1)[1]))

    def publish(self, version: int) -> None:
        with ModelRegistryClient(self.rs.address) as registry:
            registry.publish(version, to_bytes(self.policy.state_dict()))

    def stats(self) -> replay_buffer_pb2.BufferStats:
        return self.buffer_client.stats()

    def take(self, n: int) -> list[replay_buffer_pb2.SampledChunk]:
        """n chunks sampled from the buffer, as a trainer's reader samples them."""
        return self.buffer_client.sample(n, "test", wait=5.0, data_timeout=30.0)

    def stop(self) -> None:
        self.buffer_client.close()
        for s in (self.bs, self.rs, self.ms):
            s.stop(0)
        self.registry.stop()
        self.buffer.stop()
        self.manager_client.close()


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**overrides: Any) -> Cluster:
        made.append(Cluster(tmp_path, overrides))
        return made[-1]

    yield make
    for c in made:
        c.stop()
