"""Thin client of the rollout-manager. Every call has a deadline; the calls a caller waits on are
retried through a manager restart (`Retry`), the periodic ones (heartbeat, episode reports) try
once: the next period is their retry."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from overworld.core.config import RunConfig, from_yaml
from overworld.core.grpc_util import Retry, channel
from overworld.core.specs import Spaces
from overworld.v1 import rollout_manager_pb2 as pb
from overworld.v1 import rollout_manager_pb2_grpc

PERIODIC_TIMEOUT = 5.0


class RolloutManagerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = channel(address)
        self.stub = rollout_manager_pb2_grpc.RolloutManagerStub(self._channel)

    def run_config(self, timeout: float = 120.0) -> RunConfig:
        """The run's config; waits (with backoff) for the manager to come up."""
        reply = Retry(timeout, attempt=5).unary(self.stub.GetRunConfig, pb.GetRunConfigRequest(), "GetRunConfig")
        return from_yaml(reply.config_yaml)

    def register(self, request: pb.RegisterRequest, timeout: float = 120.0) -> pb.RegisterResponse:
        return Retry(timeout, attempt=10).unary(self.stub.Register, request, "Register")

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return self.stub.Heartbeat(request, timeout=PERIODIC_TIMEOUT)

    def report_episodes(self, request: pb.ReportEpisodesRequest) -> None:
        self.stub.ReportEpisodes(request, timeout=PERIODIC_TIMEOUT)

    def deregister(self, worker_id: str, timeout: float = 5.0) -> None:
        Retry(timeout).unary(self.stub.Deregister, pb.DeregisterRequest(worker_id=worker_id), "Deregister")

    def upload_video(self, chunks: Iterable[pb.VideoChunk], timeout: float = 120.0) -> pb.VideoInfo:
        return self.stub.UploadVideo(iter(chunks), timeout=timeout)

    def request_video(self, iteration: int, timeout: float = 10.0) -> str:
        request = pb.RequestVideoRequest(iteration=iteration)
        return Retry(timeout).unary(self.stub.RequestVideo, request, "RequestVideo").request_id

    def list_videos(self, timeout: float = 5.0) -> list[pb.VideoInfo]:
        return list(Retry(timeout).unary(self.stub.ListVideos, pb.ListVideosRequest(), "ListVideos").videos)

    def spaces(self) -> Spaces | None:
        try:
            return Spaces.from_proto(self.stub.GetSpaces(pb.GetSpacesRequest(), timeout=PERIODIC_TIMEOUT))
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                return None
            raise

    def fleet_status(self, timeout: float = PERIODIC_TIMEOUT) -> pb.FleetStatus:
        return Retry(timeout, attempt=PERIODIC_TIMEOUT).unary(self.stub.GetFleetStatus, pb.GetFleetStatusRequest(),
                                                             "GetFleetStatus")

    def fleet_status_future(self, timeout: float) -> grpc.Future:
        """The fleet's status, asked now and answered while the caller works (waits up to `timeout` for
        a manager that is restarting)."""
        return self.stub.GetFleetStatus.future(pb.GetFleetStatusRequest(), timeout=timeout, wait_for_ready=True)

    def close(self) -> None:
        self._channel.close()
