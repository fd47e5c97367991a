"""Thin client of the rollout-manager. Every call has a deadline (`timeout=`); the calls a caller waits
on are retried through a manager restart (`Retry`), the periodic ones (heartbeat, episode reports,
spaces) try once: the next period is their retry (core/client.py states the rule)."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from overworld.core.client import ServiceClient
from overworld.core.config import RunConfig, from_yaml
from overworld.core.grpc_util import Retry
from overworld.core.specs import Spaces
from overworld.v1 import rollout_manager_pb2 as pb
from overworld.v1 import rollout_manager_pb2_grpc

PERIODIC_TIMEOUT = 5.0


class RolloutManagerClient(ServiceClient):
    def __init__(self, address: str, *, channel: grpc.Channel | None = None) -> None:
        super().__init__(address, rollout_manager_pb2_grpc.RolloutManagerStub, "rollout-manager", channel=channel)

    def run_config(self, *, timeout: float = 120.0) -> RunConfig:
        """The run's config. Retried (5 s attempts): waits for the manager to come up."""
        reply = Retry(timeout, attempt=5).unary(self._stub.GetRunConfig, pb.GetRunConfigRequest(), "GetRunConfig")
        return from_yaml(reply.config_yaml)

    def register(self, request: pb.RegisterRequest, *, timeout: float = 120.0) -> pb.RegisterResponse:
        """A worker joins the fleet. Retried (10 s attempts)."""
        return Retry(timeout, attempt=10).unary(self._stub.Register, request, "Register")

    def heartbeat(self, request: pb.HeartbeatRequest, *, timeout: float = PERIODIC_TIMEOUT) -> pb.HeartbeatResponse:
        """A worker's periodic report (its lease; what the manager asks of it back). One attempt."""
        return self._stub.Heartbeat(request, timeout=timeout)

    def report_episodes(self, request: pb.ReportEpisodesRequest, *, timeout: float = PERIODIC_TIMEOUT) -> None:
        """A worker's finished episodes since its last report. One attempt: the next report resends them."""
        self._stub.ReportEpisodes(request, timeout=timeout)

    def deregister(self, worker_id: str, *, timeout: float = 5.0) -> None:
        """A worker leaves the fleet. Retried."""
        Retry(timeout).unary(self._stub.Deregister, pb.DeregisterRequest(worker_id=worker_id), "Deregister")

    def upload_video(self, chunks: Iterable[pb.VideoChunk], *, timeout: float = 120.0) -> pb.VideoInfo:
        """A recorded video: its info, then its bytes. One attempt (the chunks are consumed as sent)."""
        return self._stub.UploadVideo(iter(chunks), timeout=timeout)

    def request_video(self, iteration: int = 0, *, timeout: float = 10.0) -> str:
        """Ask one worker to record a video (of the policy at `iteration`); the request's id. Retried."""
        request = pb.RequestVideoRequest(iteration=iteration)
        return Retry(timeout).unary(self._stub.RequestVideo, request, "RequestVideo").request_id

    def list_videos(self, *, timeout: float = 5.0) -> list[pb.VideoInfo]:
        """The videos uploaded so far. Retried."""
        return list(Retry(timeout).unary(self._stub.ListVideos, pb.ListVideosRequest(), "ListVideos").videos)

    def spaces(self, *, timeout: float = PERIODIC_TIMEOUT) -> Spaces | None:
        """The run's observation and action spaces, or None while no worker has registered them (or the
        manager is unreachable). One attempt: its callers poll."""
        try:
            return Spaces.from_proto(self._stub.GetSpaces(pb.GetSpacesRequest(), timeout=timeout))
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                return None
            raise

    def fleet_status(self, *, timeout: float = PERIODIC_TIMEOUT) -> pb.FleetStatus:
        """The fleet: its workers, steps, episodes, videos. Retried (5 s attempts)."""
        return Retry(timeout, attempt=PERIODIC_TIMEOUT).unary(self._stub.GetFleetStatus, pb.GetFleetStatusRequest(),
                                                             "GetFleetStatus")

    def leases(self, *, timeout: float = PERIODIC_TIMEOUT) -> pb.Leases:
        """The workers holding a live lease, and how long a lease lasts. One attempt: its caller polls."""
        return self._stub.ListLeases(pb.ListLeasesRequest(), timeout=timeout)

    def fleet_status_future(self, *, timeout: float) -> grpc.Future:
        """The fleet's status, asked now and answered while the caller works (waits up to `timeout` for
        a manager that is restarting: wait_for_ready, one attempt)."""
        return self._stub.GetFleetStatus.future(pb.GetFleetStatusRequest(), timeout=timeout, wait_for_ready=True)
