"""A worker steps a fragment only with room reserved in the replay buffer: while the learner samples
nothing, it steps exactly the fragments the rate limiter will admit and then waits at a fragment
boundary; each sample lets it step one more (docs/replay_buffer.md, "Reserving before stepping")."""

from __future__ import annotations

import time

from tests.rollout_worker.conftest import Cluster, T
from tests.rollout_worker.test_worker import Running, wait_for

# spi 1, error 2, min size 1: three fragments ahead of the sampler; four env slots.
LIMITED = {"rollout_config": {"replay_buffer_config": {
    "samples_per_insert": 1.0, "samples_per_insert_error": 2.0, "min_size_to_sample": 1}}}


def test_a_worker_steps_only_the_fragments_the_buffer_has_room_for(make_cluster) -> None:
    cluster: Cluster = make_cluster(**LIMITED)
    run = Running(cluster, "inprocess")
    worker = run.worker
    try:
        wait_for(lambda: worker.sender.sent == 3, 60, "three fragments acknowledged")
        wait_for(lambda: int(worker.waiting_for_room.sum()) == 4, 30, "every slot waiting for room")
        time.sleep(0.5)
        assert worker.fragments_completed == 3 and worker.env_steps == 3 * T  # nothing stepped in vain
        assert cluster.stats().dropped_chunks == {}
        taken = cluster.take(2)
        assert len(taken) == 2
        wait_for(lambda: worker.sender.sent == 5, 30, "two more fragments, one per sample")
        time.sleep(0.5)
        assert worker.fragments_completed == 5 and worker.env_steps == 5 * T
    finally:
        run.stop()
    stats = cluster.stats()
    assert stats.reserved_fragments == 0  # the stopped worker gave back the room it did not use
    assert stats.inserted_fragments == 5


def test_without_a_rate_limiter_a_worker_never_waits_for_room(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    run = Running(cluster, "inprocess")
    worker = run.worker
    try:
        wait_for(lambda: worker.sender.sent >= 20, 60, "twenty fragments")
        assert not worker.waiting_for_room.any()
    finally:
        run.stop()
