"""A worker steps a fragment only with room reserved in the replay buffer: while the learner samples
nothing, it steps exactly the fragments the rate limiter will admit and then waits at a fragment
boundary; each sample lets it step one more (docs/replay_buffer.md, "Reserving before stepping")."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.rollout_worker import faulty_envs
from tests.rollout_worker.conftest import Cluster, T
from tests.rollout_worker.test_worker import Running, wait_for
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]
LEASE = 5.0  # the Cluster's rollout-manager lease

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


def test_the_seconds_slots_wait_for_room_are_counted_and_reach_the_fleet(make_cluster) -> None:
    """The idle share: env-slot seconds waiting for room over env-slot seconds in all, in the heartbeat."""
    cluster: Cluster = make_cluster(**LIMITED)
    run = Running(cluster, "inprocess")
    worker = run.worker
    try:
        wait_for(lambda: int(worker.waiting_for_room.sum()) == 4, 60, "every slot waiting for room")
        time.sleep(1.5)
        waited, slot_seconds = worker.room_wait_seconds, worker.env_slot_seconds
        assert 4 * 1.0 <= waited <= slot_seconds  # four slots waited at least the 1.5 s, give or take a loop
        fleet = lambda: cluster.manager_client.fleet_status()  # noqa: E731
        wait_for(lambda: fleet().room_wait_seconds >= waited, 10, "the wait reported in a heartbeat")
        status = fleet()
        assert status.room_wait_seconds <= status.env_slot_seconds
        assert status.workers[0].room_wait_seconds == status.room_wait_seconds
    finally:
        run.stop()


def test_room_goes_to_the_slots_already_stepping_before_new_ones_begin(make_cluster) -> None:
    """Three workers of four slots, room for three fragments: the fleet keeps stepping the slots whose
    episodes are under way (an episode that ends mid-fragment rolls into the next one in the same slot)
    instead of spreading the room over all twelve slots, so its episodes end as one worker's would."""
    cluster: Cluster = make_cluster(**LIMITED)
    runs = [Running(cluster, "inprocess") for _ in range(3)]
    try:
        stepped = lambda: sum(int((r.worker.cutter.sequence > 0).sum()) for r in runs)  # noqa: E731
        wait_for(lambda: stepped() >= 3, 60, "three slots stepped a fragment")
        for _ in range(12):  # the learner's pace: one fragment at a time, each once the room is taken again
            wait_for(lambda: sum(int(r.worker.waiting_for_room.sum()) for r in runs) == 12, 30, "all slots waiting")
            time.sleep(0.6)  # every worker has asked again (its ask is remembered for DEMAND_SECONDS)
            assert len(cluster.take(1)) == 1
        sent = sum(r.worker.sender.sent for r in runs)
        assert sent >= 12
        assert stepped() <= 4, [r.worker.cutter.sequence.tolist() for r in runs]
    finally:
        for r in runs:
            r.stop()


def test_the_room_of_a_killed_worker_is_back_within_its_lease(make_cluster, tmp_path: Path) -> None:
    """Chaos: a worker process holding room dies (SIGKILL, mid-fragment); the fleet goes on once its
    lease lapses (5 s here) and the front drops it from two lease lists, not after the reservation ttl
    (60 s). Fragments of a paced env (50 ms a step) keep the dying worker's room under way."""
    # by file: site-packages holds a `tests` package of its own (opensimplex's)
    cluster: Cluster = make_cluster(env_generator=str(Path(faulty_envs.__file__).resolve()) + ":paced",
                                    env_kwargs={"seconds": 0.05}, **LIMITED)
    manager_addr, buffer_addr, registry_addr = cluster.addresses
    env = {**os.environ, "OVERWORLD_LOG_FORMAT": "text", "PYTHONPATH": str(ROOT / "services")}
    port = free_port()
    with open(tmp_path / "doomed.log", "wb") as log_file:
        doomed = subprocess.Popen(
            [sys.executable, "-m", "overworld.cli", "serve", "rollout-worker", "--host", "127.0.0.1", "--port",
             str(port), "--metrics-port", "0", "--rollout-manager", manager_addr, "--replay-buffer", buffer_addr,
             "--model-registry", registry_addr], stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: cluster.stats().reserved_fragments == 3, 90, "the worker to hold the whole band")
        doomed.kill()
        killed_at = time.monotonic()
        doomed.wait(10)
        run = Running(cluster, "inprocess")
        try:
            wait_for(lambda: run.worker.sender.sent >= 1, LEASE + 8, "the surviving worker to step into the band")
            recovered = time.monotonic() - killed_at
            assert recovered < LEASE + 4, recovered  # the lease and two refreshes, give or take a fragment
            assert cluster.stats().expired_reservations >= 1
            for _ in range(3):  # the learner goes on sampling what the fleet steps
                assert len(cluster.take(1)) == 1
        finally:
            run.stop()
    finally:
        if doomed.poll() is None:
            doomed.kill()
