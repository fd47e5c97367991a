"""The stores go away under a working fleet: redis-server restarted, then the S3-protocol server gone for
30 s (SIGSTOP: unreachable, its objects kept). A real worker streams to a replay-buffer front on Redis +
S3, reports episodes to a rollout-manager whose state is in Redis, and takes weights from a registry on
S3 while the trainer's side publishes. Writers back off (the worker's bounded queue fills and it waits),
nothing acknowledged is lost or counted twice, and everything goes on when the stores return."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest

from overworld.core.blobs.s3 import S3BlobStore
from overworld.core.grpc_util import wait_healthy
from overworld.core.wire.weights import to_bytes
from overworld.model_registry.client import ModelRegistryClient
from overworld.model_registry.server import ModelRegistryService
from overworld.replay_buffer.client import ReplayBufferClient
from overworld.rollout_manager.server import RolloutManagerService
from overworld.rollout_manager.state import open_state_store
from tests.replay_buffer.rb_support import start_front_process
from tests.rollout_worker.conftest import Cluster
from tests.rollout_worker.test_worker import Running, wait_for
from tests.support import RedisServer, S3Server, free_port

S3_OUTAGE_SECONDS = 30.0
QUEUE = 4


@pytest.mark.slow
def test_redis_restart_and_s3_outage_lose_nothing_acknowledged(tmp_path: Path, monkeypatch) -> None:
    redis, s3 = RedisServer(tmp_path / "redis"), S3Server()
    redis.start()
    s3.start()
    for key, value in s3.env.items():
        monkeypatch.setenv(key, value)
    run_id = f"outage-{uuid.uuid4().hex[:8]}"
    cluster = Cluster(tmp_path, {"run_id": run_id, "rollout_config": {"to_send_queue_size": QUEUE}},
                      manager_state=open_state_store(redis.url, str(tmp_path), run_id),
                      registry_blobs=S3BlobStore.from_url(f"s3://outage/{run_id}/registry"))
    port = free_port()
    front_address = f"127.0.0.1:{port}"
    front = start_front_process(cluster.addresses[0], redis.url, f"s3://outage/{run_id}", port, 0, s3.env,
                                tmp_path / "front.log")
    wait_healthy(front_address, timeout=60)
    cluster.addresses = (cluster.addresses[0], front_address, cluster.addresses[2])
    run = Running(cluster)
    w = run.worker
    try:
        wait_for(lambda: w.sender.sent >= 10 and cluster.manager._episodes > 0, 90, "fragments and episodes")

        redis.stop()  # SIGTERM: its append-only file has every acknowledged write (appendfsync always)
        time.sleep(3.0)
        redis.start()
        sent = w.sender.sent
        wait_for(lambda: w.sender.sent >= sent + 10, 90, "fragments after Redis came back")

        publisher = ModelRegistryClient(cluster.addresses[2])
        published: list = []
        s3.pause()
        paused = time.monotonic()
        thread = threading.Thread(target=lambda: published.append(
            publisher.publish(2, to_bytes(cluster.policy.state_dict()), parent=1, timeout=120)))
        thread.start()
        wait_for(lambda: w.sender.waiting and w.sender.depth() == QUEUE, 20,
                 "the worker held by its full queue while S3 is away")
        time.sleep(2.0)  # an insert whose blob was stored just before the pause may still be acknowledged
        stalled = w.sender.sent
        time.sleep(max(0.0, S3_OUTAGE_SECONDS - (time.monotonic() - paused)))
        assert w.sender.depth() == QUEUE and w.sender.sent == stalled  # it waits; nothing is dropped
        assert not published  # the publish waits for the store too
        s3.resume()
        thread.join(120)
        assert published and published[0].version == 2
        wait_for(lambda: w.model_version == 2, 60, "version 2 at the worker")
        wait_for(lambda: w.sender.sent >= stalled + 10, 90, "fragments after S3 came back")
        publisher.close()
        run.stop()  # flushes every complete fragment and the last episodes
        with ReplayBufferClient(front_address) as buffer:
            stats = buffer.stats(timeout=10)
        assert stats.inserted_fragments == stats.fragments == w.sender.sent == w.fragments_completed
        # the manager's state in Redis: every episode once (those reported during the outage were sent
        # again), every env step once
        manager = RolloutManagerService(cluster.config, state=open_state_store(redis.url, str(tmp_path), run_id))
        assert manager._episodes == w.episodes.finished > 0
        assert manager._departed_steps == w.env_steps
        assert ModelRegistryService(S3BlobStore.from_url(f"s3://outage/{run_id}/registry")).latest() == 2
    finally:
        if run.thread.is_alive():
            run.stop()
        front.kill()
        front.wait(10)
        cluster.stop()
        redis.stop()
        s3.stop()
