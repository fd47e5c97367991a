"""The replay buffer, the registry and the manager go away mid-run and come back on the same
address: the worker holds at most to_send_queue_size fragments meanwhile (backpressure), then
resumes; nothing complete is lost."""

from __future__ import annotations

import time

from overworld.core.grpc_util import serve
from overworld.v1 import (
    model_registry_pb2_grpc,
    rollout_manager_pb2_grpc,
)
from tests.rollout_worker.test_worker import Running, wait_for


def test_outages_of_buffer_registry_and_manager(make_cluster) -> None:
    cluster = make_cluster(rollout_config={"to_send_queue_size": 3})
    run = Running(cluster)
    w = run.worker
    try:
        wait_for(lambda: w.sender.sent >= 6, 60, "fragments")
        # replay buffer down: the worker fills its queue and blocks, never more than 3 fragments
        cluster.bs.stop(0)
        wait_for(lambda: w.sender.depth() == 3, 30, "a full send queue")
        steps = w.env_steps
        time.sleep(1.5)
        assert w.sender.depth() == 3 and w.env_steps - steps <= 4 * 16 * 2  # blocked after the group in flight
        # ... and the registry and the manager too
        cluster.rs.stop(0)
        cluster.ms.stop(0)
        time.sleep(2.0)
        cluster.serve_buffer_again()
        cluster.rs = serve([(model_registry_pb2_grpc.add_ModelRegistryServicer_to_server, cluster.registry, "r")],
                           port=int(cluster.addresses[2].rsplit(":", 1)[1]))
        cluster.ms = serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server, cluster.manager, "m")],
                           port=int(cluster.addresses[0].rsplit(":", 1)[1]))
        sent = w.sender.sent
        wait_for(lambda: w.sender.sent >= sent + 6, 60, "fragments after the buffer came back")
        cluster.publish(2)
        wait_for(lambda: w.model_version == 2, 60, "weights after the registry came back")
        episodes = cluster.manager._episodes
        wait_for(lambda: cluster.manager._episodes > episodes, 30, "episode reports after the manager came back")
    finally:
        run.stop()
    assert cluster.stats().inserted_fragments == w.sender.sent == w.fragments_completed
