"""Video requests (explicit and every record_video_interval model versions), uploads, listing,
and `overworld status` against a real rollout-manager."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from overworld.core.blobs.store import LocalBlobStore
from overworld.core.config import load_config
from overworld.core.grpc_util import Server, serve
from overworld.core.specs import Spaces, TensorSpec
from overworld.launch.status import print_status
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.rollout_manager.server import RolloutManagerService
from overworld.rollout_manager.videos import video_store_url
from overworld.v1 import rollout_manager_pb2 as pb
from overworld.v1 import rollout_manager_pb2_grpc

SPACES = Spaces(obs={"obs": TensorSpec((4,), "float32")}, action={"action": TensorSpec((), "int64")})
MP4 = b"\x00\x00\x00\x20ftypisom" + b"\x00" * 100


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[tuple[RolloutManagerService, RolloutManagerClient]]:
    config = load_config({"run_id": "r1", "train_config": {"record_video_interval": 2, "batches_per_iteration": 2,
                                                           "gradient_accumulation": 1},
                          "rollout_config": {"worker_config": {"video_episodes": 1}}})
    service = RolloutManagerService(config, lease_seconds=5, video_store=LocalBlobStore(tmp_path / "v"))
    server: Server = serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server, service, "m")])
    yield service, RolloutManagerClient(server.address)
    server.stop(0)


def register(client: RolloutManagerClient) -> str:
    return client.register(pb.RegisterRequest(hostname="h", num_envs=4, spaces=SPACES.to_proto())).worker_id


def upload(client: RolloutManagerClient, info: pb.VideoInfo, data: bytes = MP4) -> pb.VideoInfo:
    return client.upload_video([pb.VideoChunk(info=info, data=data[:10]), pb.VideoChunk(data=data[10:])])


def test_video_store_url() -> None:
    assert video_store_url("output/videos", "/w") == "/w/output/videos"
    assert video_store_url("/abs/v", "/w") == "/abs/v"
    assert video_store_url("output/videos", "/w", "s3://b/p") == "s3://b/p/output/videos"
    assert video_store_url("s3://x/y", "/w", "s3://b/p") == "s3://x/y"


def test_explicit_request_is_handed_to_one_worker_and_listed(manager) -> None:
    service, client = manager
    a, b = register(client), register(client)
    rid = client.request_video(7)
    first = client.heartbeat(pb.HeartbeatRequest(worker_id=a))
    assert first.record_video and first.video_request_id == rid
    assert not client.heartbeat(pb.HeartbeatRequest(worker_id=b)).record_video  # only one worker gets it
    assert client.heartbeat(pb.HeartbeatRequest(worker_id=a)).video_request_id == rid  # until it uploads
    stored = upload(client, pb.VideoInfo(request_id=rid, worker_id=a, env_slot=2, task="t", sum_reward=3, length=9))
    assert stored.iteration == 7 and stored.size_bytes == len(MP4) and stored.key.startswith("videos/r1/")
    assert service.videos.store.get(stored.key) == MP4
    assert not client.heartbeat(pb.HeartbeatRequest(worker_id=a)).record_video
    (listed,) = client.list_videos()
    assert listed.key == stored.key and client.fleet_status().videos == 1
    with pytest.raises(grpc.RpcError) as err:
        upload(client, pb.VideoInfo(request_id="x", worker_id=a), b"not a video at all")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_request_of_a_departed_worker_goes_to_another(manager) -> None:
    _, client = manager
    a, b = register(client), register(client)
    rid = client.request_video()
    assert client.heartbeat(pb.HeartbeatRequest(worker_id=a)).video_request_id == rid
    client.deregister(a)
    assert client.heartbeat(pb.HeartbeatRequest(worker_id=b)).video_request_id == rid
    assert client.fleet_status().pending_video_requests == 1


def test_every_record_video_interval_model_versions(manager) -> None:
    _, client = manager
    a = register(client)
    assert not client.heartbeat(pb.HeartbeatRequest(worker_id=a, model_version=1)).record_video
    rid = client.heartbeat(pb.HeartbeatRequest(worker_id=a, model_version=2)).video_request_id
    assert rid
    upload(client, pb.VideoInfo(request_id=rid, worker_id=a))
    assert not client.heartbeat(pb.HeartbeatRequest(worker_id=a, model_version=3)).record_video
    assert client.heartbeat(pb.HeartbeatRequest(worker_id=a, model_version=4)).record_video


def test_status_prints_the_fleet(manager, capsys: pytest.CaptureFixture[str]) -> None:
    service, client = manager
    a = register(client)
    client.heartbeat(pb.HeartbeatRequest(worker_id=a, env_steps=1234, fragments_sent=5, model_version=3,
                                         env_steps_per_second=321.0, env_restarts={"died": 2, "error": 1},
                                         fragments_dropped=3, envs_ready=3, send_queue_depth=1))
    client.report_episodes(pb.ReportEpisodesRequest(worker_id=a, episodes=[
        pb.EpisodeStats(task="cow", sum_reward=2.0, discounted_reward=1.5, length=10,
                        extras={"achievement_eat_cow": 1.0})]))
    upload(client, pb.VideoInfo(request_id="", worker_id=a, sum_reward=2.0, length=10))
    assert print_status(client.address) == 0
    out = capsys.readouterr().out
    assert "1 workers, 1,234 env steps, 1 episodes" in out
    assert a in out and "3/4" in out and "321" in out and "died=2,error=1" in out
    assert "task cow: 1 episodes, return 2.00, discounted 1.50, length 10" in out and "achievement_eat_cow=1.00" in out
    assert "videos: 1 stored" in out and "videos/r1/" in out
    assert print_status("127.0.0.1:1") == 1
