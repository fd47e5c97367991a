"""`overworld serve model-registry` / `python -m overworld.model_registry`: versioned weights, tags,
and the push of each new version to the watching workers (by relay or star)."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path
from typing import Any

from overworld.serve import (
    DEFAULT_PORTS,
    S3_ENVIRONMENT,
    SERVER_ENVIRONMENT,
    Served,
    add_server_flags,
    env_flag,
)

SUMMARY = ("The model-registry: versioned weights in a blob store, tags, retention, and the push of every new "
           "version to the rollout workers. Its index is the blob store's manifests: it takes no --index.")
DEFAULT_PORT = DEFAULT_PORTS["model-registry"]
ENVIRONMENT = {**SERVER_ENVIRONMENT, **S3_ENVIRONMENT}
DEFAULT_MAX_RPCS = 1024


def add_flags(p: argparse.ArgumentParser) -> None:
    from overworld.model_registry.payload import DEFAULT_CHUNK, LARGEST_MESSAGE
    from overworld.model_registry.server import DEFAULT_RELAY_FANOUT

    add_server_flags(p, DEFAULT_PORT)
    env_flag(p, "--blobs", "",
             "where the versions are kept: a directory or s3://BUCKET/PREFIX; default: registry/ under "
             "--workdir")
    env_flag(p, "--workdir", ".", "where a local store goes")
    env_flag(p, "--retain", 20, "versions kept besides tagged ones")
    env_flag(p, "--registry-chunk-bytes", DEFAULT_CHUNK,
             "small tensors are grouped into messages of up to this size")
    env_flag(p, "--registry-largest-message-bytes", LARGEST_MESSAGE,
             "a tensor up to this size is sent in one message, where the worker views it without a copy")
    env_flag(p, "--registry-cut-through", 0,
             "1: announce a version when its publish starts and stream it to the watchers as it arrives (the"
             " star only: needs --registry-relay-fanout 0)")
    env_flag(p, "--registry-relay-fanout", DEFAULT_RELAY_FANOUT,
             "workers relay each new version to one another in this many stripes, each forwarded to this "
             "many workers (the registry sends one copy in all); 0: every worker fetches the whole version "
             "from the registry (a star)")
    env_flag(p, "--weights-port", 0,
             "port of the weights stream, where workers fetch each version's chunks (the chart's 50064); "
             "0: any free port (the announcements say which)")
    env_flag(p, "--publish-port", 0,
             "port where the trainer publishes each version over the weights stream (the chart's 50065); 0: any "
             "free port (GetPublishEndpoint says which)")
    env_flag(p, "--registry-max-rpcs", DEFAULT_MAX_RPCS,
             "gRPC server threads: each open Watch and each running Fetch holds one")


def build(args: argparse.Namespace, done: threading.Event) -> Any:
    from overworld.core.blobs.urls import open_blob_store
    from overworld.core.grpc_util import serve
    from overworld.model_registry.server import ModelRegistryService, registration

    blobs_url = args.blobs or str(Path(args.workdir) / "registry")
    try:
        service = ModelRegistryService(open_blob_store(blobs_url), retain=args.retain,
                                       chunk_size=args.registry_chunk_bytes,
                                       largest_message=args.registry_largest_message_bytes,
                                       cut_through=bool(args.registry_cut_through),
                                       relay_fanout=args.registry_relay_fanout, weights_host=args.host,
                                       weights_port=args.weights_port, publish_port=args.publish_port)
    except ValueError as err:
        raise SystemExit(f"model-registry: {err}") from None
    # Every open watch stream and running fetch holds a thread: size the pool for a large fleet.
    return Served(serve([registration(service)], args.host, args.port, max_workers=args.registry_max_rpcs),
                  service.stop)
