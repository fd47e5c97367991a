"""The gae service: stateless advantage estimation over batches of chains."""

from __future__ import annotations

import time

import grpc
import numpy as np
from prometheus_client import Counter, Histogram

from overworld.core.grpc_util import Refused
from overworld.core.wire import tensors
from overworld.gae.advantage import gae, vtrace
from overworld.v1 import gae_pb2, gae_pb2_grpc

REQUESTS = Counter("overworld_gae_requests_total", "Estimate calls")
LATENCY = Histogram("overworld_gae_latency_seconds", "Estimate latency")

FLOATS = ("reward", "value", "bootstrap_value")
BOOLS = ("terminated", "truncated")


def _check(data: dict[str, np.ndarray], vtrace_on: bool) -> tuple[int, int]:
    required = [*FLOATS, *BOOLS, "next_value"] + (["behaviour_logp", "target_logp"] if vtrace_on else [])
    missing = [k for k in required if k not in data]
    if missing:
        raise ValueError(f"missing tensors: {', '.join(missing)}")
    if data["reward"].ndim != 2:
        raise ValueError(f"reward must be (B, T), got shape {data['reward'].shape}")
    B, T = data["reward"].shape
    for k in required:
        want = (B,) if k == "next_value" else (B, T)
        dtype = np.bool_ if k in BOOLS else np.float32
        if data[k].shape != want:
            raise ValueError(f"{k}: shape {data[k].shape}, expected {want}")
        if data[k].dtype != dtype:
            raise ValueError(f"{k}: dtype {data[k].dtype}, expected {np.dtype(dtype).name}")
        if dtype is np.float32 and not np.isfinite(data[k]).all():
            raise ValueError(f"{k}: contains NaN or infinity")
    return B, T


class GaeService(gae_pb2_grpc.GaeServicer):
    def Estimate(self, request: gae_pb2.EstimateRequest, context: grpc.ServicerContext) -> gae_pb2.EstimateResponse:
        started = time.monotonic()
        REQUESTS.inc()
        if not 0.0 < request.discount <= 1.0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"discount must be in (0, 1], got {request.discount}")
        if not 0.0 <= request.gae_lambda <= 1.0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"gae_lambda must be in [0, 1], got {request.gae_lambda}")
        if request.vtrace_rho_clip < 0 or request.vtrace_c_clip < 0:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "vtrace_rho_clip and vtrace_c_clip must be > 0 (0: the "
                  f"default 1.0), got {request.vtrace_rho_clip} and {request.vtrace_c_clip}")
        try:
            data = tensors.decode(request.tensors)
            _check(data, request.vtrace)
        except ValueError as err:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from None
        common = {k: data[k] for k in (*FLOATS, *BOOLS, "next_value")}
        if request.vtrace:
            adv, target = vtrace(**common, behaviour_logp=data["behaviour_logp"], target_logp=data["target_logp"],
                                 discount=request.discount, gae_lambda=request.gae_lambda,
                                 rho_clip=request.vtrace_rho_clip or 1.0,
                                 c_clip=request.vtrace_c_clip or 1.0)
        else:
            adv, target = gae(**common, discount=request.discount, gae_lambda=request.gae_lambda)
        LATENCY.observe(time.monotonic() - started)
        return gae_pb2.EstimateResponse(tensors=tensors.encode({"advantage": adv, "value_target": target}))
