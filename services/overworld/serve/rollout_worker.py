"""`overworld serve rollout-worker` / `python -m overworld.rollout_worker`: environments, batched
inference, fragments to the replay buffer, and the weights relay."""

from __future__ import annotations

import argparse
import threading
from typing import Any

from overworld.serve import (
    DEFAULT_PORTS,
    SERVER_ENVIRONMENT,
    accept_workdir,
    add_server_flags,
    address_flag,
    env_flag,
)

SUMMARY = ("A rollout worker: steps the run's environments, runs batched inference, streams fragments to the "
           "replay buffer, swaps in each new model version and relays it to other workers.")
DEFAULT_PORT = DEFAULT_PORTS["rollout-worker"]
ENVIRONMENT = {
    **SERVER_ENVIRONMENT,
    "OVERWORLD_WEIGHTS_PRECISION": "fetch weights in bfloat16 / float16 (default: as published)",
    "OVERWORLD_WEIGHTS_VERIFY": "1: check the sha256 of versions fetched from the registry too",
    "OVERWORLD_RELAY_STALL_SECONDS": "a relay that sends nothing for this long (no data for twice as long) is "
                                     "given up for the registry (10)",
    "OVERWORLD_POD_IP": "where the other workers reach its weights relay (default: the address the registry sees)",
    "OVERWORLD_ACK_LOG": "a file each acknowledgement from the replay buffer is appended to (default: none)",
    "OVERWORLD_ENV_BACKEND": "subprocess (default) or inprocess; overrides worker_config.env_backend",
}


def add_flags(p: argparse.ArgumentParser) -> None:
    add_server_flags(p, DEFAULT_PORT)
    address_flag(p, "rollout-manager")
    address_flag(p, "replay-buffer")
    address_flag(p, "model-registry")
    env_flag(p, "--weights-port", 0,
             "port of its weights relay, where other workers fetch the versions it receives (the chart's "
             "50066); 0: any free port (it tells the registry which)")
    env_flag(p, "--flush-timeout", 30.0,
             "seconds its stop waits for the replay buffer to take the fragments it holds")
    accept_workdir(p)


def build(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.rollout_worker.process import RolloutWorkerProcess

    return RolloutWorkerProcess(args.rollout_manager, args.replay_buffer, args.model_registry, args.host,
                                args.port, done, flush_timeout=args.flush_timeout, weights_port=args.weights_port)
