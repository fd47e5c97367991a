"""A rollout-manager killed with SIGKILL and started again on the same address takes up where it was:
run id, spaces, fleet (worker ids, leases, cumulative counters, departed workers' steps), episode
statistics, in Redis or in a file beside the run. Workers keep their ids; a retried episode report is
not counted twice; `--fresh-state` starts a new fleet."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from overworld.core.config import RunConfig
from overworld.core.grpc_util import serve, wait_healthy
from overworld.core.specs import Spaces, TensorSpec
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_manager.server import RolloutManagerService
from overworld.rollout_manager.state import StateUnavailable, open_state_store
from overworld.v1 import rollout_manager_pb2 as pb
from overworld.v1 import rollout_manager_pb2_grpc
from tests.support import RedisServer, free_port

SPACES = Spaces(obs={"obs": TensorSpec((4,), "float32")}, action={"action": TensorSpec((), "int64")})


class ManagerProcess:
    def __init__(self, tmp_path: Path, index: str) -> None:
        self.tmp_path, self.index = tmp_path, index
        self.config = tmp_path / "config.yaml"
        self.config.write_text(f"run_id: recover-{uuid.uuid4().hex[:8]}\n")  # Redis keys are per run id
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> None:
        log = open(self.tmp_path / "manager.log", "ab")  # noqa: SIM115 - the child holds it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "overworld.cli", "serve", "rollout-manager", "--host", "127.0.0.1", "--port",
             str(self.port), "--metrics-port", "0", "--config", str(self.config), "--workdir", str(self.tmp_path),
             "--index", self.index, "--lease-seconds", "30", *extra],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OVERWORLD_LOG_FORMAT": "text"})
        log.close()
        wait_healthy(self.address, timeout=60)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(params=["file", "redis"])
def manager(request: pytest.FixtureRequest, tmp_path: Path):
    index = "memory" if request.param == "file" else request.getfixturevalue("redis_server").url
    proc = ManagerProcess(tmp_path, index)
    proc.start("--fresh-state")
    yield proc
    proc.stop()


def register(client: RolloutManagerClient) -> pb.RegisterResponse:
    return client.register(pb.RegisterRequest(hostname="h", num_envs=4, spaces=SPACES.to_proto()), timeout=10)


def episodes(n: int, reward: float) -> list[pb.EpisodeStats]:
    return [pb.EpisodeStats(task="cartpole", sum_reward=reward, discounted_reward=reward / 2, length=int(reward),
                            extras={"x": 1.0}) for _ in range(n)]


def test_sigkill_restart_restores_fleet_spaces_and_episode_statistics(manager: ManagerProcess) -> None:
    client = RolloutManagerClient(manager.address)
    try:
        a, b = register(client), register(client)
        client.heartbeat(pb.HeartbeatRequest(worker_id=a.worker_id, env_steps=100, fragments_sent=3,
                                             send_queue_depth=1))
        client.heartbeat(pb.HeartbeatRequest(worker_id=b.worker_id, env_steps=40, fragments_sent=2))
        client.deregister(b.worker_id)  # its steps still count
        report = pb.ReportEpisodesRequest(worker_id=a.worker_id, episodes=episodes(3, 20.0), report_sequence=1)
        client.report_episodes(report)
        before = client.fleet_status()
        assert (before.env_steps, before.episodes, before.fragments_sent) == (140, 3, 5)

        manager.kill()
        with pytest.raises(grpc.RpcError):
            client.fleet_status(timeout=1)
        manager.start()

        after = client.fleet_status(timeout=30)
        assert after.run_id == before.run_id
        assert after.fleet_id == before.fleet_id != ""  # the same fleet: its env steps go on
        assert (after.env_steps, after.episodes, after.fragments_sent) == (140, 3, 5)
        assert [w.worker_id for w in after.workers] == [a.worker_id]
        assert after.tasks[0].mean_return_last_100 == pytest.approx(20.0)
        assert after.tasks[0].mean_extras_last_100["x"] == pytest.approx(1.0)
        assert client.spaces(timeout=5) == SPACES
        # the worker keeps its id and lease, and its cumulative counters go on
        reply = client.heartbeat(pb.HeartbeatRequest(worker_id=a.worker_id, env_steps=160, fragments_sent=4))
        assert reply.lease_valid
        # a report retried after the restart (its acknowledgement was lost) is not counted twice
        client.report_episodes(report)
        client.report_episodes(pb.ReportEpisodesRequest(worker_id=a.worker_id, episodes=episodes(1, 40.0),
                                                        report_sequence=2))
        status = client.fleet_status()
        assert (status.env_steps, status.episodes, status.fragments_sent) == (200, 4, 6)
        assert status.mean_return_last_100 == pytest.approx(25.0)
        assert register(client).worker_index == 2  # indices (env seeds) are never handed out twice

        manager.kill()
        manager.start("--fresh-state")  # a new `overworld run` of the same run id: a new fleet
        fresh = client.fleet_status(timeout=30)
        assert (fresh.env_steps, fresh.episodes, len(fresh.workers)) == (0, 0, 0)
        assert fresh.fleet_id not in ("", before.fleet_id)  # counting from zero, under a new name
    finally:
        client.close()


def test_a_worker_whose_lease_expired_is_counted_as_losing_its_queue() -> None:
    service = RolloutManagerService(RunConfig(run_id="lost"), lease_seconds=0.3)
    server = serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server, service,
                     "overworld.v1.RolloutManager")])
    client = RolloutManagerClient(server.address)
    try:
        a = register(client)
        client.heartbeat(pb.HeartbeatRequest(worker_id=a.worker_id, env_steps=64, fragments_sent=2,
                                             send_queue_depth=3))
        time.sleep(0.6)
        status = client.fleet_status()
        assert not status.workers and status.env_steps == 64
        assert (status.fragments_sent, status.fragments_lost) == (2, 3)
        assert not client.heartbeat(pb.HeartbeatRequest(worker_id=a.worker_id)).lease_valid
    finally:
        client.close()
        server.stop(0)


def test_the_state_lives_in_a_redis_that_asks_for_a_password(tmp_path: Path) -> None:
    """The chart's and kustomize's Redis ask for a password, given apart from the URL
    ($OVERWORLD_REDIS_PASSWORD, as the replay buffer's index gets it)."""
    redis = RedisServer(tmp_path / "redis", password="pw")
    redis.start()
    try:
        with pytest.raises(StateUnavailable):
            open_state_store(redis.url, str(tmp_path), "run").load()
        open_state_store(redis.url, str(tmp_path), "run", password="pw").save({"run": {"episodes": 3}})
        assert open_state_store(redis.url, str(tmp_path), "run", password="pw").load() == {"run": {"episodes": 3}}
    finally:
        redis.stop()


def test_a_departure_whose_save_failed_is_counted_once_after_a_restart(tmp_path: Path) -> None:
    """A lease that lapses while the state store is down: the failed save's removal of the worker's record
    goes with the next save that works. (It was dropped: the next save of the run counted the worker as
    departed while its record stayed, and a restarted manager counted its fragments twice; the chaos
    test's acknowledged fragments then exceeded the workers' own log.)"""
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    try:
        service = RolloutManagerService(RunConfig(run_id="outage"), state=open_state_store(redis.url, "", "outage"),
                                        fresh=True, lease_seconds=30)
        a = service.Register(pb.RegisterRequest(hostname="a", num_envs=4, spaces=SPACES.to_proto()), None)
        service.Heartbeat(pb.HeartbeatRequest(worker_id=a.worker_id, env_steps=640, fragments_sent=100), None)
        redis.stop(kill=True)
        service.lease_seconds = 0.1
        time.sleep(0.3)
        assert not service.Heartbeat(pb.HeartbeatRequest(worker_id=a.worker_id), None).lease_valid  # not saved
        service.lease_seconds = 30
        redis.start()
        service.Register(pb.RegisterRequest(hostname="b", num_envs=4, spaces=SPACES.to_proto()), None)  # saved
        before = service.GetFleetStatus(pb.GetFleetStatusRequest(), None)
        restarted = RolloutManagerService(RunConfig(run_id="outage"), state=open_state_store(redis.url, "", "outage"))
        after = restarted.GetFleetStatus(pb.GetFleetStatusRequest(), None)
        assert (before.fragments_sent, before.env_steps, len(before.workers)) == (100, 640, 1)
        assert (after.fragments_sent, after.env_steps, len(after.workers)) == (100, 640, 1)
    finally:
        redis.stop()
