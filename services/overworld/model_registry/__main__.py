"""`python -m overworld.model_registry`: the registry alone, the same code as `overworld serve
model-registry` with the same flags and environment variables (used by the tests and the benches)."""

from __future__ import annotations

import argparse
import threading

from overworld.core.service import env_default, run_until_signalled
from overworld.services import add_registry_flags
from overworld.services import model_registry as build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m overworld.model_registry")
    p.add_argument("--host", default=env_default("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=env_default("port", 50054))
    p.add_argument("--metrics-port", type=int, default=env_default("metrics-port", 0))
    p.add_argument("--blobs", default=env_default("blobs", ""))
    p.add_argument("--workdir", default=env_default("workdir", "."))
    p.add_argument("--retain", type=int, default=env_default("retain", 20))
    add_registry_flags(p)
    args = p.parse_args(argv)
    done = threading.Event()
    return run_until_signalled("model-registry", lambda: build(args, done), args.metrics_port, done)


if __name__ == "__main__":
    raise SystemExit(main())
