"""A rollout worker's own service (RolloutWorker), as the launcher and tools call it: its status and a
drain. (Its weights relay, the weights stream between workers, is the registry's: model_registry/worker/relay.py.)"""

from __future__ import annotations

import grpc

from overworld.core.client import ServiceClient
from overworld.v1 import rollout_worker_pb2 as pb
from overworld.v1 import rollout_worker_pb2_grpc


class RolloutWorkerClient(ServiceClient):
    def __init__(self, address: str, *, channel: grpc.Channel | None = None) -> None:
        super().__init__(address, rollout_worker_pb2_grpc.RolloutWorkerStub, "rollout-worker", channel=channel)

    def status(self, *, timeout: float = 5.0) -> pb.WorkerStatus:
        """The worker's status; one attempt (its callers poll)."""
        return self._stub.GetStatus(pb.GetWorkerStatusRequest(), timeout=timeout)

    def drain(self, *, timeout: float = 30.0) -> pb.DrainResponse:
        """Ask the worker to drain: stop stepping, send its complete fragments, deregister, exit. One attempt."""
        return self._stub.Drain(pb.DrainRequest(), timeout=timeout)
