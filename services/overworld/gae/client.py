"""The gae service's client: advantages and value targets of a batch (GAE, or V-trace)."""

from __future__ import annotations

import grpc
import numpy as np

from overworld.core.client import ServiceClient
from overworld.core.grpc_util import Retry
from overworld.core.wire import tensors
from overworld.v1 import gae_pb2, gae_pb2_grpc


class GaeClient(ServiceClient):
    def __init__(self, address: str, *, channel: grpc.Channel | None = None) -> None:
        super().__init__(address, gae_pb2_grpc.GaeStub, "gae", channel=channel)

    def estimate(self, batch: dict[str, np.ndarray], discount: float, gae_lambda: float,
                 vtrace: bool = False, rho_clip: float = 1.0, c_clip: float = 1.0, *,
                 timeout: float = 60.0) -> tuple[np.ndarray, np.ndarray]:
        """(advantage, value_target) of `batch`. Retried: gae is stateless, a call that broke with the
        service is simply made again."""
        request = gae_pb2.EstimateRequest(discount=discount, gae_lambda=gae_lambda, tensors=tensors.encode(batch),
                                          vtrace=vtrace, vtrace_rho_clip=rho_clip, vtrace_c_clip=c_clip)
        reply = Retry(timeout).unary(self._stub.Estimate, request, "gae.Estimate")
        out = tensors.decode(reply.tensors)
        return out["advantage"], out["value_target"]
