"""`overworld serve gae` / `python -m overworld.gae`: stateless advantage estimation."""

from __future__ import annotations

import argparse
import threading
from typing import Any

from overworld.serve import DEFAULT_PORTS, SERVER_ENVIRONMENT, Served, accept_workdir, add_server_flags

SUMMARY = "The gae service: GAE and V-trace over batches of chains (stateless)."
DEFAULT_PORT = DEFAULT_PORTS["gae"]
ENVIRONMENT = SERVER_ENVIRONMENT


def add_flags(p: argparse.ArgumentParser) -> None:
    add_server_flags(p, DEFAULT_PORT)
    accept_workdir(p)


def build(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.core.grpc_util import FRONT_MAX_CONNECTION_AGE_S, serve
    from overworld.gae.server import GaeService
    from overworld.v1 import gae_pb2_grpc

    return Served(serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")],
                        args.host, args.port, max_connection_age=FRONT_MAX_CONNECTION_AGE_S))
