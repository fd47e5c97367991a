"""The trainer driver's status endpoint, as its callers see it: rank 0 reports progress, `overworld
run`, the MineStudio facade and the run-controller read it (and ask it to stop through the driver)."""

from __future__ import annotations

import grpc

from overworld.core.client import ServiceClient
from overworld.core.grpc_util import Retry
from overworld.core.security.tls import aio_channel
from overworld.v1 import trainer_pb2 as pb
from overworld.v1 import trainer_pb2_grpc


class TrainerClient(ServiceClient):
    def __init__(self, address: str, *, channel: grpc.Channel | None = None) -> None:
        super().__init__(address, trainer_pb2_grpc.TrainerStub, "trainer", channel=channel)

    def status(self, *, timeout: float = 5.0) -> pb.TrainerStatus:
        """The trainer's progress; one attempt (its callers poll)."""
        return self._stub.GetStatus(pb.GetTrainerStatusRequest(), timeout=timeout)

    def report(self, status: pb.TrainerStatus, *, timeout: float = 10.0) -> bool:
        """Rank 0's progress; True when the driver asks training to stop. One attempt: the next
        iteration reports again."""
        return bool(self._stub.ReportProgress(status, timeout=timeout).stop)

    def request_stop(self, seconds_left: float, reason: str, *, timeout: float = 5.0) -> pb.TrainerStatus:
        """A node of the trainer's is going in `seconds_left` (a Ray worker pod's preStop): checkpoint
        before then and end the attempt as failed, for KubeRay's retry to resume. Retried: it matters."""
        request = pb.StopRequest(seconds_left=seconds_left, reason=reason)
        return Retry(timeout).unary(self._stub.RequestStop, request, "trainer.RequestStop")


async def read_status(address: str, timeout: float = 5.0) -> pb.TrainerStatus:
    """The trainer's status from asyncio code (the run-controller); raises grpc.aio.AioRpcError when it
    does not answer."""
    async with aio_channel(address, "trainer") as ch:
        return await trainer_pb2_grpc.TrainerStub(ch).GetStatus(pb.GetTrainerStatusRequest(), timeout=timeout)
