"""A rollout worker's own service (RolloutWorker), as the launcher and tools call it: its status and a
drain. (Its weights relay, the weights stream between workers, is the registry's: model_registry/relay.py.)"""

from __future__ import annotations

from overworld.core.grpc_util import channel
from overworld.v1 import rollout_worker_pb2 as pb
from overworld.v1 import rollout_worker_pb2_grpc


class RolloutWorkerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = channel(address)
        self._stub = rollout_worker_pb2_grpc.RolloutWorkerStub(self._channel)

    def status(self, timeout: float = 5.0) -> pb.WorkerStatus:
        return self._stub.GetStatus(pb.GetWorkerStatusRequest(), timeout=timeout)

    def drain(self, request: pb.DrainRequest, timeout: float = 30.0) -> pb.DrainResponse:
        return self._stub.Drain(request, timeout=timeout)

    def close(self) -> None:
        self._channel.close()
