"""A worker whose lease expired (it was too slow, or the manager lost it) registers again under a new
id; its heartbeats then report only what came after, so the fleet counts every env step, fragment and
episode exactly once."""

from __future__ import annotations

from tests.rollout_worker.test_worker import Running, wait_for


def test_a_worker_that_registers_again_is_counted_once(make_cluster) -> None:
    cluster = make_cluster()
    manager = cluster.manager
    run = Running(cluster)
    w = run.worker
    try:
        wait_for(lambda: w.env_steps > 0 and manager._workers and next(iter(manager._workers.values())).env_steps > 0,
                 60, "a heartbeat with env steps")
        first_id = w.worker_id
        manager.lease_seconds = 0.01  # the lease runs out: the manager removes the worker
        wait_for(lambda: not manager.GetFleetStatus(None, None).workers, 10, "the worker to be removed")
        manager.lease_seconds = 5.0
        wait_for(lambda: w.worker_id != first_id and len(manager._workers) == 1, 30, "the worker to register again")
        steps = w.env_steps
        wait_for(lambda: next(iter(manager._workers.values())).env_steps > 0 and w.env_steps > steps, 30,
                 "heartbeats under the new id")
    finally:
        run.stop()  # last heartbeat and episode report, then deregister
    status = manager.GetFleetStatus(None, None)
    assert status.env_steps == w.env_steps
    assert status.fragments_sent == w.sender.sent
    assert status.episodes == w.episodes.finished
