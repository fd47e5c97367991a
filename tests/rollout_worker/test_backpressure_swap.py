"""A worker held up by backpressure (its send queue full: the buffer gone, or its rate limiter waiting on
the trainer) still swaps in the versions the registry pushes: it acts with them as soon as it may
step again, and the push completes (the scale bench's pushes with the trainer stopped hung on this)."""

from __future__ import annotations

from tests.rollout_worker.conftest import Cluster
from tests.rollout_worker.test_worker import Running, wait_for


def test_a_worker_blocked_on_a_full_queue_swaps_in_new_weights(make_cluster) -> None:
    cluster: Cluster = make_cluster()
    run = Running(cluster, "inprocess")
    try:
        worker = run.worker
        wait_for(lambda: worker.model_version == 1 and worker.sender.sent > 0, 60, "the worker streaming")
        cluster.bs.stop(0)  # the buffer goes away: the queue fills and the loop blocks in put()
        # held in put(): a full queue alone is not enough, the worker may still be stepping its next fragment
        wait_for(lambda: worker.sender.waiting, 60, "the worker held by a full send queue")
        steps = worker.env_steps
        cluster.publish(2)
        wait_for(lambda: worker.model_version == 2, 15, "version 2 swapped in by the blocked worker")
        assert worker.env_steps == steps  # it did not step meanwhile: it swapped while waiting
    finally:
        run.stop()
