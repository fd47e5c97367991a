"""How each service is assembled from its flags: the one place `overworld serve` and
`overworld run` share. Each builder returns something with stop(grace)."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import Any

from overworld.core.blobs import open_blob_store
from overworld.core.config import load_config
from overworld.core.grpc_util import FRONT_MAX_CONNECTION_AGE_S, serve

DEFAULT_PORTS = {"rollout-manager": 50051, "replay-buffer": 50052, "gae": 50053, "model-registry": 50054,
                 "trainer": 50055, "rollout-worker": 50056, "run-controller": 0}


class Served:
    def __init__(self, server: Any, *closers: Any) -> None:
        self.server = server
        self.closers = closers

    def stop(self, grace: float = 5.0) -> None:
        for closer in self.closers:
            closer()
        self.server.stop(grace)


def rollout_manager(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.core.config import config_hash
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


def replay_buffer(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.core.config import config_hash
    from overworld.replay_buffer.index import MemoryIndex
    from overworld.replay_buffer.rate_limiter import RateLimiter
    from overworld.replay_buffer.server import ReplayBufferService, add_to_server
    from overworld.rollout_manager.client import RolloutManagerClient

    manager = RolloutManagerClient(args.rollout_manager)
    config = manager.run_config()
    rb = config.rollout_config.replay_buffer_config
    db = rb.database_config
    index_url = args.index or db.index
    blobs_url = args.blobs or db.blobs or str(Path(args.workdir) / db.path)
    limiter = RateLimiter.create(rb.samples_per_insert, rb.samples_per_insert_error, rb.min_size_to_sample,
                                 rb.max_reuse)
    if index_url == "memory":
        index: Any = MemoryIndex(rb.max_chunks, rb.max_reuse, rb.max_staleness, rb.fragments_per_chunk, limiter,
                                 seed=config.seed)
    else:
        from overworld.replay_buffer.redis_index import RedisIndex

        # The password from a Secret, apart from the URL: the URL may then sit in a ConfigMap or a log.
        index = RedisIndex.from_url(index_url, config.run_id, rb, limiter,
                                    password=os.environ.get("OVERWORLD_REDIS_PASSWORD") or None)
    cached: list[Any] = []

    def spaces() -> Any:
        if not cached:
            found = manager.spaces()
            if found is not None:
                cached.append(found)
        return cached[0] if cached else None

    service = ReplayBufferService(index, open_blob_store(blobs_url), config.run_id, config.rollout_config.fragment_length,
                                  rb.fragments_per_chunk, rb.max_chunks, spaces, rb.max_fragment_bytes,
                                  fragments_per_report=rb.fragments_per_report)
    if not rb.keep_on_resume:
        # Replicas started together clear once; a plain restart of one front clears nothing.
        service.discard_buffered(token=f"{config_hash(config)}:{config.train_config.resume or ''}")
    # add_to_server: the same wire protocol, fragments stored as received and sent as stored.
    return Served(serve([(add_to_server, service, "overworld.v1.ReplayBuffer")], args.host, args.port,
                        max_connection_age=FRONT_MAX_CONNECTION_AGE_S), service.stop, index.close)


def gae(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.gae.server import GaeService
    from overworld.v1 import gae_pb2_grpc

    return Served(serve([(gae_pb2_grpc.add_GaeServicer_to_server, GaeService(), "overworld.v1.Gae")],
                        args.host, args.port, max_connection_age=FRONT_MAX_CONNECTION_AGE_S))


def model_registry(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.model_registry.server import ModelRegistryService, registration

    blobs_url = args.blobs or str(Path(args.workdir) / "registry")
    try:
        service = ModelRegistryService(open_blob_store(blobs_url), retain=args.retain,
                                       chunk_size=args.registry_chunk_bytes,
                                       largest_message=args.registry_largest_message_bytes,
                                       cut_through=bool(args.registry_cut_through),
                                       relay_fanout=args.registry_relay_fanout)
    except ValueError as err:
        raise SystemExit(f"model-registry: {err}") from None
    # Every open watch stream and running fetch holds a thread: size the pool for a large fleet.
    return Served(serve([registration(service)], args.host, args.port, max_workers=args.registry_max_rpcs),
                  service.stop)


def add_registry_flags(p: argparse.ArgumentParser) -> None:
    """The model-registry's own flags (`overworld serve model-registry`, `python -m overworld.model_registry`)."""
    from overworld.core.service import env_default
    from overworld.model_registry.payload import DEFAULT_CHUNK, LARGEST_MESSAGE
    from overworld.model_registry.server import DEFAULT_RELAY_FANOUT

    p.add_argument("--registry-chunk-bytes", type=int, default=env_default("registry-chunk-bytes", DEFAULT_CHUNK),
                   help="model-registry: small tensors are grouped into messages of up to this size")
    p.add_argument("--registry-largest-message-bytes", type=int,
                   default=env_default("registry-largest-message-bytes", LARGEST_MESSAGE),
                   help="model-registry: a tensor up to this size is sent in one message, where the worker views "
                        "it without a copy")
    p.add_argument("--registry-cut-through", type=int, default=env_default("registry-cut-through", 0),
                   help="model-registry: 1: announce a version when its publish starts and stream it to the "
                        "watchers as it arrives (the star only: needs --registry-relay-fanout 0)")
    p.add_argument("--registry-relay-fanout", type=int,
                   default=env_default("registry-relay-fanout", DEFAULT_RELAY_FANOUT),
                   help="model-registry: workers relay each new version to one another in this many stripes, "
                        "each forwarded to this many workers (the registry sends one copy in all); 0: every "
                        "worker fetches the whole version from the registry (a star)")
    p.add_argument("--registry-max-rpcs", type=int, default=env_default("registry-max-rpcs", 1024),
                   help="model-registry: gRPC server threads: each open Watch and each running Fetch holds one")


def trainer(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.trainer.service import TrainerDriver

    return TrainerDriver(args.rollout_manager, args.replay_buffer, args.gae, args.model_registry, args.host,
                         args.port, args.ray_address, str(Path(args.workdir).resolve()), args.resume, done,
                         config_path=args.config, save_path=args.save_path)


def rollout_worker(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.rollout_worker.service import RolloutWorkerProcess

    return RolloutWorkerProcess(args.rollout_manager, args.replay_buffer, args.model_registry, args.host,
                                args.port, done, flush_timeout=args.flush_timeout)


BUILDERS = {"rollout-manager": rollout_manager, "replay-buffer": replay_buffer, "gae": gae,
            "model-registry": model_registry, "trainer": trainer, "rollout-worker": rollout_worker}
