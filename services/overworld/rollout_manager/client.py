from __future__ import annotations

import grpc

from overworld.core.config import RunConfig, from_yaml
from overworld.core.grpc_util import channel, retry
from overworld.core.specs import Spaces
from overworld.v1 import rollout_manager_pb2 as pb
from overworld.v1 import rollout_manager_pb2_grpc


class RolloutManagerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = channel(address)
        self.stub = rollout_manager_pb2_grpc.RolloutManagerStub(self._channel)

    def run_config(self, timeout: float = 120.0) -> RunConfig:
        """The run's config; waits (with backoff) for the manager to come up."""
        reply = retry(lambda: self.stub.GetRunConfig(pb.GetRunConfigRequest(), timeout=5), "GetRunConfig", timeout)
        return from_yaml(reply.config_yaml)

    def spaces(self) -> Spaces | None:
        try:
            return Spaces.from_proto(self.stub.GetSpaces(pb.GetSpacesRequest(), timeout=5))
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE):
                return None
            raise

    def fleet_status(self, timeout: float = 5.0) -> pb.FleetStatus:
        return self.stub.GetFleetStatus(pb.GetFleetStatusRequest(), timeout=timeout)

    def close(self) -> None:
        self._channel.close()
