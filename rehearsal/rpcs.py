"""Every RPC of every Overworld service, from the protos, and raw calls to them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from overworld.v1 import (
    gae_pb2,
    model_registry_pb2,
    replay_buffer_pb2,
    rollout_manager_pb2,
    rollout_worker_pb2,
    trainer_pb2,
)

# service (as `overworld serve` names it) -> its proto service
PROTOS = {"rollout-manager": rollout_manager_pb2.DESCRIPTOR.services_by_name["RolloutManager"],
          "replay-buffer": replay_buffer_pb2.DESCRIPTOR.services_by_name["ReplayBuffer"],
          "gae": gae_pb2.DESCRIPTOR.services_by_name["Gae"],
          "model-registry": model_registry_pb2.DESCRIPTOR.services_by_name["ModelRegistry"],
          "trainer": trainer_pb2.DESCRIPTOR.services_by_name["Trainer"],
          "rollout-worker": rollout_worker_pb2.DESCRIPTOR.services_by_name["RolloutWorker"]}


@dataclass(frozen=True)
class Rpc:
    service: str  # rollout-manager, ...
    path: str  # /overworld.v1.RolloutManager/Register
    client_streaming: bool
    server_streaming: bool
    request_type: Any

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[1]

    def __str__(self) -> str:
        return self.path


RPCS = [Rpc(service, f"/{proto.full_name}/{m.name}", m.client_streaming, m.server_streaming, m.input_type)
        for service, proto in PROTOS.items() for m in proto.methods]


def _identity(b: bytes) -> bytes:
    return b


def call_raw(channel: grpc.Channel, rpc: Rpc, messages: Iterable[bytes], timeout: float
             ) -> tuple[grpc.StatusCode, str]:
    """Send raw request bytes (no serializer in the way) and drain the answer: (status code, details)."""
    kind = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
            (True, True): "stream_stream"}[(rpc.client_streaming, rpc.server_streaming)]
    method = getattr(channel, kind)(rpc.path, request_serializer=_identity, response_deserializer=_identity)
    messages = list(messages)
    request: Any = iter(messages) if rpc.client_streaming else (messages[0] if messages else b"")
    try:
        if rpc.server_streaming:
            for _ in method(request, timeout=timeout):
                pass
        else:
            method(request, timeout=timeout)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""
