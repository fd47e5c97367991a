"""`python -m overworld.model_registry`: the registry alone, with the same flags and environment
variables as `overworld serve model-registry` (used by the tests and the bench)."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

from overworld.core.blobs import open_blob_store
from overworld.core.grpc_util import serve
from overworld.core.service import env_default, run_until_signalled
from overworld.model_registry.server import DEFAULT_CHUNK, LARGEST_MESSAGE, ModelRegistryService, registration


class _Served:
    def __init__(self, server: object, service: ModelRegistryService) -> None:
        self.server, self.service = server, service

    def stop(self, grace: float = 5.0) -> None:
        self.service.stop()
        self.server.stop(grace)  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m overworld.model_registry")
    p.add_argument("--host", default=env_default("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env_default("port", 50054))
    p.add_argument("--metrics-port", type=int, default=env_default("metrics-port", 0))
    p.add_argument("--blobs", default=env_default("blobs", ""))
    p.add_argument("--workdir", default=env_default("workdir", "."))
    p.add_argument("--retain", type=int, default=env_default("retain", 20))
    p.add_argument("--chunk-bytes", type=int, default=env_default("registry-chunk-bytes", DEFAULT_CHUNK))
    p.add_argument("--largest-message-bytes", type=int,
                   default=env_default("registry-largest-message-bytes", LARGEST_MESSAGE),
                   help="a tensor up to this size is sent in one message, where the worker views it without a copy")
    p.add_argument("--cut-through", type=int, default=env_default("registry-cut-through", 0),
                   help="1: announce a version when its publish starts and stream it to the watchers as it "
                        "arrives (push time max(upload, fan-out) rather than their sum, when the registry has "
                        "CPU to spare); 0: announce once it is received and verified")
    p.add_argument("--max-rpcs", type=int, default=env_default("registry-max-rpcs", 1024),
                   help="gRPC server threads: each open Watch and each running Fetch holds one")
    args = p.parse_args(argv)

    def start() -> _Served:
        blobs = open_blob_store(args.blobs or str(Path(args.workdir) / "registry"))
        service = ModelRegistryService(blobs, retain=args.retain, chunk_size=args.chunk_bytes,
                                       largest_message=args.largest_message_bytes,
                                       cut_through=bool(args.cut_through))
        return _Served(serve([registration(service)], args.host, args.port, max_workers=args.max_rpcs), service)

    return run_until_signalled("model-registry", start, args.metrics_port, threading.Event())


if __name__ == "__main__":
    raise SystemExit(main())
