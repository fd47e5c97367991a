"""A real rollout worker (env subprocesses, shared memory) against real manager, buffer and
registry servers on loopback sockets."""

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from overworld.core.blobs import LocalBlobStore
from overworld.core.config import load_config
from overworld.core.fragment import Fragment, validate
from overworld.core.grpc_util import channel, serve
from overworld.core.weights import to_bytes
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.server import ModelRegistryService
from overworld.replay_buffer.index import MemoryIndex
from overworld.replay_buffer.server import ReplayBufferService
from overworld.rollout_manager.server import RolloutManagerService
from overworld.rollout_worker.env_pool import EnvPool
from overworld.rollout_worker.worker import RolloutWorker, run_spaces
from overworld.v1 import (
    model_registry_pb2_grpc,
    replay_buffer_pb2,
    replay_buffer_pb2_grpc,
    rollout_manager_pb2_grpc,
)

T = 16


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict]:
    config = load_config({
        "run_id": "wtest", "env_kwargs": {"id": "CartPole-v1"},
        "rollout_config": {"fragment_length": T, "to_send_queue_size": 8,
                           "worker_config": {"num_envs": 4, "num_env_processes": 2, "device": "cpu"},
                           "replay_buffer_config": {"max_chunks": 1000, "max_reuse": 1, "max_staleness": 100}},
        "train_config": {"batches_per_iteration": 1, "gradient_accumulation": 1, "context_length": T}})
    manager = RolloutManagerService(config)
    ms = serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server, manager, "m")])
    registry = ModelRegistryService(LocalBlobStore(tmp_path / "registry"))
    rs = serve([(model_registry_pb2_grpc.add_ModelRegistryServicer_to_server, registry, "r")])
    rb = config.rollout_config.replay_buffer_config
    buffer = ReplayBufferService(MemoryIndex(rb.max_chunks, rb.max_reuse, rb.max_staleness, 1), LocalBlobStore(tmp_path / "b"),
                                 "wtest", T, 1, rb.max_chunks, lambda: manager._spaces)
    bs = serve([(replay_buffer_pb2_grpc.add_ReplayBufferServicer_to_server, buffer, "b")])
    spaces, policy, _, _ = run_spaces(config)
    ModelRegistryClient(rs.address).publish(1, to_bytes(policy.state_dict()))
    replay_buffer_pb2_grpc.ReplayBufferStub(channel(bs.address)).SetModelVersion(
        replay_buffer_pb2.SetModelVersionRequest(model_version=1))  # as the trainer does when it publishes
    yield {"config": config, "manager": manager, "registry": rs, "buffer": bs, "spaces": spaces, "policy": policy,
           "addresses": (ms.address, bs.address, rs.address)}
    for s in (bs, rs, ms):
        s.stop(0)
    registry.stop()
    buffer.stop()


def test_env_pool_steps_in_shared_memory(cluster) -> None:
    config, spaces = cluster["config"], cluster["spaces"]
    pool = EnvPool(config.env_generator, {"id": "CartPole-v1"}, spaces, 4, 2, seed=0)
    try:
        obs = pool.reset()
        assert obs["obs"].shape == (4, 4)
        ended = 0
        for _ in range(300):
            result = pool.step({"action": np.zeros(4, np.int64)})  # always push left: episodes end fast
            ended += int((result.terminated | result.truncated).sum())
        assert ended >= 4 and np.isfinite(result.obs["obs"]).all()
    finally:
        pool.close()


def test_worker_streams_valid_fragments_swaps_weights_and_flushes(cluster) -> None:
    manager_addr, buffer_addr, registry_addr = cluster["addresses"]
    worker = RolloutWorker(manager_addr, buffer_addr, registry_addr)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while worker.sender.sent < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.sender.sent >= 8, "worker sent no fragments"
        policy = cluster["policy"]
        ModelRegistryClient(registry_addr).publish(2, to_bytes(policy.state_dict()))
        deadline = time.monotonic() + 30
        while worker.model_version < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.model_version == 2
        time.sleep(1.0)
    finally:
        worker.shutdown()
        thread.join(30)
    stub = replay_buffer_pb2_grpc.ReplayBufferStub(channel(buffer_addr))
    stats = stub.GetStats(replay_buffer_pb2.GetStatsRequest())
    assert stats.inserted_fragments == worker.sender.sent  # SIGTERM path: every complete fragment acknowledged
    chunks = list(stub.Sample(replay_buffer_pb2.SampleRequest(num_chunks=stats.chunks, timeout_seconds=5)))
    versions = set()
    for chunk in chunks:
        fragment = Fragment.from_proto(chunk.fragments[0])
        validate(fragment, cluster["spaces"], T, "wtest")
        versions |= set(fragment.data["model_version"].tolist())
    assert versions >= {1, 2}
    status = cluster["manager"]
    assert status._episodes > 0 and not status._workers  # episodes reported; deregistered
