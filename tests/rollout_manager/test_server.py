import time
from collections.abc import Iterator

import grpc
import pytest

from overworld.core.config import load_config
from overworld.core.grpc_util import serve
from overworld.core.specs import Spaces, TensorSpec
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_manager.server import RolloutManagerService
from overworld.v1 import rollout_manager_pb2 as pb
from overworld.v1 import rollout_manager_pb2_grpc

SPACES = Spaces(obs={"obs": TensorSpec((4,), "float32")}, action={"action": TensorSpec((), "int64")})


@pytest.fixture
def manager() -> Iterator[tuple[RolloutManagerService, RolloutManagerClient]]:
    config = load_config({"run_id": "r1", "train_config": {"batches_per_iteration": 2, "gradient_accumulation": 1}})
    service = RolloutManagerService(config, lease_seconds=30.0)  # a test that expires a lease shortens it
    server = serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server, service,
                     "overworld.v1.RolloutManager")])
    yield service, RolloutManagerClient(server.address)
    server.stop(0)


def register(client: RolloutManagerClient, spaces: Spaces = SPACES) -> pb.RegisterResponse:
    return client.register(pb.RegisterRequest(hostname="h", num_envs=4, spaces=spaces.to_proto()))


def test_run_config_and_spaces(manager) -> None:
    _, client = manager
    assert client.run_config().run_id == "r1"
    assert client.spaces() is None
    first = register(client)
    assert first.run_id == "r1" and first.worker_index == 0
    assert client.spaces() == SPACES
    assert register(client).worker_index == 1


def test_mismatched_spaces_are_refused(manager) -> None:
    _, client = manager
    register(client)
    other = Spaces(obs={"obs": TensorSpec((5,), "float32")}, action={"action": TensorSpec((), "int64")})
    with pytest.raises(grpc.RpcError) as err:
        register(client, other)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "differ" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.register(pb.RegisterRequest(hostname="h", num_envs=0, spaces=SPACES.to_proto()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_leases_heartbeats_and_departed_steps_still_count(manager) -> None:
    service, client = manager
    a, b = register(client).worker_id, register(client).worker_id
    client.heartbeat(pb.HeartbeatRequest(worker_id=a, env_steps=100))
    client.heartbeat(pb.HeartbeatRequest(worker_id=b, env_steps=50))
    assert client.fleet_status().env_steps == 150
    client.deregister(b)
    status = client.fleet_status()
    assert [w.worker_id for w in status.workers] == [a] and status.env_steps == 150
    service.lease_seconds = 0.2
    time.sleep(0.3)  # a's lease runs out
    assert not client.heartbeat(pb.HeartbeatRequest(worker_id=a, env_steps=120)).lease_valid
    status = client.fleet_status()
    assert not status.workers and status.env_steps == 150


def test_episode_statistics(manager) -> None:
    _, client = manager
    wid = register(client).worker_id
    episodes = [pb.EpisodeStats(task="cow", sum_reward=float(i), length=10, extras={"achievement_eat_cow": i % 2})
                for i in range(150)]
    client.report_episodes(pb.ReportEpisodesRequest(worker_id=wid, episodes=episodes))
    status = client.fleet_status()
    assert status.episodes == 150
    assert status.mean_return_last_100 == pytest.approx(sum(range(50, 150)) / 100)
    (task,) = status.tasks
    assert task.task == "cow" and task.mean_extras_last_100["achievement_eat_cow"] == pytest.approx(0.5)
    # Sums over every episode of the run, not the last 100 (Crafter's success rates count them all).
    early = [pb.EpisodeStats(task="cow", sum_reward=0.0, length=10, extras={"achievement_collect_wood": 1.0})
             for _ in range(30)]
    client.report_episodes(pb.ReportEpisodesRequest(worker_id=wid, episodes=early))
    (task,) = client.fleet_status().tasks
    assert task.episodes == 180 and task.total_extras["achievement_collect_wood"] == pytest.approx(30)
    assert task.total_extras["achievement_eat_cow"] == pytest.approx(75)
    with pytest.raises(grpc.RpcError) as err:
        client.report_episodes(pb.ReportEpisodesRequest(
            worker_id=wid, episodes=[pb.EpisodeStats(task="cow", sum_reward=float("nan"))]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert client.fleet_status().episodes == 180
