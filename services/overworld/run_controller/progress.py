"""The trainer's progress, read from its gRPC status (``overworld.v1.Trainer/GetStatus``).

The trainer driver runs on the Ray head pod of the attempt's RayJob; KubeRay exposes the
head's container ports through the service ``<rayClusterName>-head-svc``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from overworld.trainer.client import read_status

DEFAULT_ADDRESS = "{cluster}-head-svc.{namespace}.svc:{port}"


@dataclass(frozen=True)
class Progress:
    state: str
    model_version: int
    env_steps: int
    latest_checkpoint: str


def trainer_address(cluster: str, namespace: str) -> str:
    """Where the trainer of a Ray cluster answers; OVERWORLD_TRAINER_ADDRESS may template it."""
    template = os.environ.get("OVERWORLD_TRAINER_ADDRESS") or DEFAULT_ADDRESS
    port = os.environ.get("OVERWORLD_TRAINER_PORT") or "50055"
    return template.format(cluster=cluster, namespace=namespace, port=port)


async def read_progress(address: str, timeout: float = 5.0) -> Progress:
    """Ask the trainer for its status; raises grpc.aio.AioRpcError when it does not answer. Mutual TLS
    as the run-controller when $OVERWORLD_TLS_DIR names its credentials (the chart mounts them)."""
    status = await read_status(address, timeout)
    return Progress(
        state=status.state,
        model_version=int(status.model_version),
        env_steps=int(status.env_steps),
        latest_checkpoint=status.latest_checkpoint,
    )
