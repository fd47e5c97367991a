"""`overworld serve rollout-manager` / `python -m overworld.rollout_manager`: the run's config,
spaces, fleet and episode statistics."""

from __future__ import annotations

import argparse
import os
import threading
from typing import Any

from overworld.serve import (
    DEFAULT_PORTS,
    REDIS_ENVIRONMENT,
    S3_ENVIRONMENT,
    SERVER_ENVIRONMENT,
    Served,
    add_server_flags,
    env_flag,
)

SUMMARY = "The rollout-manager: hands out the run config, leases the fleet, keeps spaces and episode statistics."
DEFAULT_PORT = DEFAULT_PORTS["rollout-manager"]
ENVIRONMENT = {**SERVER_ENVIRONMENT, **REDIS_ENVIRONMENT, **S3_ENVIRONMENT}


def add_flags(p: argparse.ArgumentParser) -> None:
    add_server_flags(p, DEFAULT_PORT)
    env_flag(p, "--config", "", "the run config (YAML or .py); required")
    p.add_argument("--set", action="append", default=[], metavar="dotted.key=value", help="override a config key")
    env_flag(p, "--index", "",
             "where its state survives a restart: redis://HOST:PORT/DB, or memory (a file under --workdir); "
             "default: the run config's database_config.index")
    env_flag(p, "--blobs", "",
             "blob store (a directory or s3://BUCKET/PREFIX) for the videos; default: under --workdir")
    env_flag(p, "--workdir", ".", "its state file and videos when local")
    env_flag(p, "--lease-seconds", 15.0, "a worker that sends no heartbeat for this long leaves the fleet")
    env_flag(p, "--fresh-state", False,
             "start a new fleet (counters from zero) instead of restoring the saved one")


def build(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.core.config import config_hash, load_config
    from overworld.core.grpc_util import serve
    from overworld.rollout_manager.server import RolloutManagerService
    from overworld.rollout_manager.state import open_state_store
    from overworld.v1 import rollout_manager_pb2_grpc

    if not args.config:
        raise SystemExit("rollout-manager needs --config (or OVERWORLD_CONFIG)")
    config = load_config(args.config, args.set)
    # The state lives in the run's index store: Redis on a cluster, else a file under the workdir.
    index_url = args.index or config.rollout_config.replay_buffer_config.database_config.index
    state = open_state_store(index_url, args.workdir, config.run_id or config_hash(config)[:16],
                             password=os.environ.get("OVERWORLD_REDIS_PASSWORD") or None)
    service = RolloutManagerService(config, lease_seconds=args.lease_seconds, workdir=args.workdir, blobs=args.blobs,
                                    state=state, fresh=args.fresh_state)
    return Served(serve([(rollout_manager_pb2_grpc.add_RolloutManagerServicer_to_server, service,
                          "overworld.v1.RolloutManager")], args.host, args.port))
