"""A real worker streaming to a replay-buffer front on Redis + S3 that is killed with SIGKILL and started
again on its address: the worker sends again what was not acknowledged, the buffer recognises what it
had indexed already, and every fragment the worker cut is in the index exactly once."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

import pytest

from overworld.core.grpc_util import wait_healthy
from overworld.replay_buffer.client import ReplayBufferClient
from tests.replay_buffer.rb_support import start_front_process
from tests.rollout_worker.test_worker import Running, wait_for
from tests.support import free_port


@pytest.mark.slow
def test_fragments_are_sent_again_and_indexed_once_across_a_killed_front(make_cluster, redis_server, s3_server,
                                                                        tmp_path: Path, monkeypatch) -> None:
    ack_log = tmp_path / "acks.log"
    monkeypatch.setenv("OVERWORLD_ACK_LOG", str(ack_log))
    run_id = f"resend-{uuid.uuid4().hex[:8]}"
    cluster = make_cluster(run_id=run_id, rollout_config={"to_send_queue_size": 16})
    port = free_port()
    address = f"127.0.0.1:{port}"

    def start_front():
        proc = start_front_process(cluster.addresses[0], redis_server.url, f"s3://resend/{run_id}", port, 0,
                                   s3_server, tmp_path / "front.log")
        wait_healthy(address, timeout=60)
        return proc

    fronts = [start_front()]
    cluster.addresses = (cluster.addresses[0], address, cluster.addresses[2])
    run = Running(cluster)
    w = run.worker
    try:
        wait_for(lambda: w.sender.sent >= 20, 90, "fragments")
        fronts[0].send_signal(signal.SIGKILL)  # mid-stream: some fragments indexed, not acknowledged
        fronts[0].wait(10)
        fronts.append(start_front())
        sent = w.sender.sent
        wait_for(lambda: w.sender.sent >= sent + 20, 90, "fragments after the restart")
    finally:
        run.stop()  # flushes every complete fragment
        for proc in fronts:
            proc.kill()
            proc.wait(10)
    fronts = [start_front()]
    try:
        with ReplayBufferClient(address) as client:
            stats = client.stats(timeout=10)
            assert stats.inserted_fragments == stats.fragments == w.sender.sent == w.fragments_completed
            chunks = client.sample(stats.chunks, "test", wait=10, blob_refs=False, data_timeout=60)
        ids = [(f.header.worker_id, f.header.env_slot, f.header.sequence) for c in chunks for f in c.fragments]
        assert len(ids) == len(set(ids)) == w.fragments_completed
        # the worker's durable record of what was acknowledged: each fragment once, exactly those indexed
        acked = [(worker, int(slot), int(seq)) for worker, slot, seq, _ in map(str.split, ack_log.read_text().splitlines())]
        assert len(acked) == len(set(acked)) and set(acked) == set(ids)
    finally:
        for proc in fronts:
            proc.kill()
            proc.wait(10)
