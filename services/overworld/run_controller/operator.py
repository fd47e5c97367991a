"""Run the run-controller: ``python -m overworld.run_controller`` or :func:`main`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from collections.abc import Sequence

import kopf
from prometheus_client import start_http_server

from overworld.run_controller import handlers


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="overworld serve run-controller",
        description="Kubernetes operator for TrainingRun (trainingruns.overworld.dev): makes the trainer's RayJobs.",
    )
    add_flags(parser)
    return parser.parse_args(argv)


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--namespace",
        default=os.environ.get("OVERWORLD_NAMESPACE", ""),
        help="namespace to serve (env OVERWORLD_NAMESPACE); empty: every namespace (needs cluster-wide RBAC)",
    )
    parser.add_argument(
        "--liveness",
        default=os.environ.get("OVERWORLD_LIVENESS", ""),
        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz (env OVERWORLD_LIVENESS)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("OVERWORLD_METRICS_PORT", "0")),
        help="serve Prometheus metrics on this port (env OVERWORLD_METRICS_PORT); 0: off",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def main(argv: Sequence[str] | None = None) -> int:
    """Serve TrainingRuns until SIGTERM/SIGINT; returns the exit status."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """main() with its flags parsed (`overworld serve run-controller`)."""
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handlers.NAMESPACE = args.namespace or None
    if args.metrics_port:
        start_http_server(args.metrics_port)
    # One controller per namespace; no peering objects (they would need their own CRD). The identity is
    # given: kopf would otherwise look the process's user up in /etc/passwd, which fails under an
    # arbitrary runAsUser (OpenShift's random UIDs, a chart value) and ended the controller at start.
    asyncio.run(
        kopf.operator(
            standalone=True,
            identity=f"overworld-run-controller@{socket.gethostname()}/{os.getpid()}",  # type: ignore[arg-type]  # kopf wants its Identity, a NewType of str it does not export
            namespaces=[args.namespace] if args.namespace else [],
            clusterwide=not args.namespace,
            liveness_endpoint=args.liveness or None,
        )
    )
    return 0
