"""`overworld serve replay-buffer` / `python -m overworld.replay_buffer`: a front of the replay buffer
(its index in memory or Redis, its fragments in a blob store)."""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import Any

from overworld.serve import (
    DEFAULT_PORTS,
    REDIS_ENVIRONMENT,
    S3_ENVIRONMENT,
    SERVER_ENVIRONMENT,
    Served,
    add_server_flags,
    address_flag,
    env_flag,
)

SUMMARY = "A replay-buffer front: validates, stores and indexes fragments; hands out chunks to the trainer."
DEFAULT_PORT = DEFAULT_PORTS["replay-buffer"]
ENVIRONMENT = {**SERVER_ENVIRONMENT, **REDIS_ENVIRONMENT, **S3_ENVIRONMENT}


def add_flags(p: argparse.ArgumentParser) -> None:
    add_server_flags(p, DEFAULT_PORT)
    address_flag(p, "rollout-manager", "the run config and spaces")
    env_flag(p, "--index", "",
             "memory or redis://HOST:PORT/DB; default: the run config's database_config.index")
    env_flag(p, "--blobs", "",
             "fragment store: a directory or s3://BUCKET/PREFIX; default: the run config's, else "
             "database_config.path under --workdir")
    env_flag(p, "--workdir", ".", "where a local fragment store goes")
    env_flag(p, "--max-waiting-reserves", 128,
             "Reserve calls that may wait for room at once (each holds a server thread); one more that would "
             "wait is refused with RESOURCE_EXHAUSTED and asks again")


def build(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.core.blobs.urls import open_blob_store
    from overworld.core.config import config_hash
    from overworld.core.grpc_util import FRONT_MAX_CONNECTION_AGE_S, serve
    from overworld.replay_buffer.index import MemoryIndex
    from overworld.replay_buffer.leases import Leases
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
                                 seed=config.seed, sample_order=rb.sample_order)
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
                                  fragments_per_report=rb.fragments_per_report,
                                  leases=Leases(lambda: manager.leases().worker_ids),
                                  max_waiting_reserves=args.max_waiting_reserves, reservations=rb.reservations)
    if not rb.keep_on_resume:
        # Replicas started together clear once; a plain restart of one front clears nothing.
        service.discard_buffered(token=f"{config_hash(config)}:{config.train_config.resume or ''}")
    # add_to_server: the same wire protocol, fragments stored as received and sent as stored.
    # A thread per call in progress: each worker holds an Insert stream and, while its slots wait for room,
    # a Reserve call (at most --max-waiting-reserves of those wait at once); each reader a Sample call.
    # 256 threads serve a fleet of ~100 workers per front.
    return Served(serve([(add_to_server, service, "overworld.v1.ReplayBuffer")], args.host, args.port,
                        max_workers=256, max_connection_age=FRONT_MAX_CONNECTION_AGE_S), service.stop, index.close)
