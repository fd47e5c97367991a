"""How each service is assembled from its flags: one module per service here (`gae.py`,
`model_registry.py`, ...), each declaring the flags it reads (`add_flags`), the environment variables
it reads besides its flags' `OVERWORLD_<FLAG>` defaults (`ENVIRONMENT`), and how it is built from
them (`build(args, done)`, something with stop(grace)).

`overworld serve NAME`, `python -m overworld.NAME` and `overworld run` (which starts `overworld
serve NAME` processes) all go through `parser` and `serve` here: one code path, one flag set. A
builder module imports its service's code inside `build`, so that listing every service's flags
(`overworld --help`) imports none of them (the services image has no torch, the trainer's none of
kopf).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from overworld.core.service import env_default

MODULES = {
    "rollout-manager": "overworld.serve.rollout_manager",
    "replay-buffer": "overworld.serve.replay_buffer",
    "gae": "overworld.serve.gae",
    "model-registry": "overworld.serve.model_registry",
    "trainer": "overworld.serve.trainer",
    "rollout-worker": "overworld.serve.rollout_worker",
    "run-controller": "overworld.serve.run_controller",
}

# What every gRPC service reads from the environment besides its flags (core/service.py, core/grpc_util.py).
SERVER_ENVIRONMENT = {
    "OVERWORLD_HEALTH_PORT": "a plaintext port serving only grpc.health.v1.Health (kubelet's probes); 0/unset: none",
    "OVERWORLD_LOG_FORMAT": "json (default) or text",
    "OVERWORLD_LOG_LEVEL": "INFO (default), DEBUG, WARNING, ...",
    "OVERWORLD_PARENT_PID": "set by `overworld run`: stop (SIGTERM) when that process dies",
}
S3_ENVIRONMENT = {
    "OVERWORLD_S3_ENDPOINT": "the S3 endpoint (http://host:port) of an s3:// blob store",
    "OVERWORLD_S3_ACCESS_KEY": "its access key",
    "OVERWORLD_S3_SECRET_KEY": "its secret key",
}
REDIS_ENVIRONMENT = {
    "OVERWORLD_REDIS_PASSWORD": "the Redis password for a redis:// --index (wins over one in the URL)",
}


def builder(service: str) -> ModuleType:
    """The module that assembles `service`: add_flags, build (or run), ENVIRONMENT."""
    try:
        return importlib.import_module(MODULES[service])
    except KeyError:
        raise ValueError(f"no service {service!r}: one of {', '.join(MODULES)}") from None


def env_flag(p: argparse.ArgumentParser, flag: str, default: Any, help: str, **kwargs: Any) -> None:
    """--some-flag, defaulting to $OVERWORLD_SOME_FLAG (the flag wins); its help names the variable."""
    name = flag.removeprefix("--")
    variable = "OVERWORLD_" + name.upper().replace("-", "_")
    if isinstance(default, bool):
        kwargs.setdefault("action", "store_true")
    elif not isinstance(default, str):
        kwargs.setdefault("type", type(default))
    p.add_argument(flag, default=env_default(name, default), help=f"{help} (${variable})", **kwargs)


# Where each service listens unless told otherwise, and where the others look for it on one machine.
DEFAULT_PORTS = {"rollout-manager": 50051, "replay-buffer": 50052, "gae": 50053, "model-registry": 50054,
                 "trainer": 50055, "rollout-worker": 50056}


def address_flag(p: argparse.ArgumentParser, service: str, what: str = "") -> None:
    """--SERVICE host:port, defaulting to this machine and the service's default port."""
    env_flag(p, f"--{service}", f"127.0.0.1:{DEFAULT_PORTS[service]}",
             f"host:port of the {service}" + (f" ({what})" if what else ""))


def add_server_flags(p: argparse.ArgumentParser, port: int) -> None:
    """The flags of every gRPC service: where it listens, its metrics port, its identity."""
    env_flag(p, "--host", "0.0.0.0", "bind address")
    env_flag(p, "--port", port, f"gRPC port; 0: {port}")
    env_flag(p, "--metrics-port", 9090, "Prometheus /metrics port; 0: none")
    add_tls_flags(p)


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    env_flag(p, "--tls-dir", "",
             "this process's identity: a directory with tls.crt, tls.key and ca.crt (mutual TLS)")
    env_flag(p, "--insecure", False, "plaintext gRPC, no authorization: for debugging only")


def accept_workdir(p: argparse.ArgumentParser) -> None:
    """--workdir for a service that keeps nothing on disk: `overworld run` gives it to every service
    (launch/supervisor.py), so it is accepted, and left out of --help."""
    p.add_argument("--workdir", default=".", help=argparse.SUPPRESS)


def use_tls_flags(args: argparse.Namespace, log: bool = True) -> None:
    """--tls-dir / --insecure to this process's credentials (core/security/tls.py), through the environment so
    that what it starts (the trainer's Ray workers) has the same identity."""
    from overworld.core.security import tls

    if args.tls_dir and args.insecure:
        raise SystemExit("--tls-dir and --insecure exclude each other")
    if args.tls_dir:
        os.environ[tls.TLS_DIR_ENV] = str(Path(args.tls_dir).resolve())
    else:
        os.environ.pop(tls.TLS_DIR_ENV, None)
    tls.reset()
    if not args.tls_dir and log and not args.insecure:
        logging.getLogger("overworld").warning(
            "no --tls-dir (OVERWORLD_TLS_DIR): plaintext gRPC, any client may call every method")


def environment(service: str) -> dict[str, str]:
    """The environment variables `service` reads besides its flags' defaults: name -> meaning."""
    return dict(builder(service).ENVIRONMENT)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The epilog as written, every flag's default shown."""


def describe(service: str, parser: argparse.ArgumentParser) -> None:
    """The service's summary and the environment variables it reads into its parser's --help."""
    module = builder(service)
    parser.description = textwrap.fill(module.SUMMARY, 100)
    lines = [f"  {name}: {meaning}" for name, meaning in module.ENVIRONMENT.items()]
    parser.epilog = "environment variables it reads besides its flags':\n" + "\n".join(lines) if lines else None
    parser.formatter_class = _HelpFormatter


def parser(service: str, prog: str | None = None, local: bool = False) -> argparse.ArgumentParser:
    """`service`'s own parser. `local` (`python -m overworld.SERVICE`): on loopback and without a
    metrics port unless told otherwise, for tests and benches on one machine."""
    p = argparse.ArgumentParser(prog=prog or f"overworld serve {service}")
    builder(service).add_flags(p)
    describe(service, p)
    if local:
        flags = p._option_string_actions  # noqa: SLF001 - which of the common flags this service has
        if "--host" in flags:
            p.set_defaults(host=env_default("host", "127.0.0.1"))
        if "--metrics-port" in flags:
            p.set_defaults(metrics_port=env_default("metrics-port", 0))
    return p


def parse(service: str, argv: list[str], prog: str | None = None, local: bool = False) -> argparse.Namespace:
    return parser(service, prog, local).parse_args(argv)


def serve(service: str, args: argparse.Namespace) -> int:
    """Run `service` as this process until SIGTERM (or until it ends by itself): the exit status."""
    from overworld.core.service import EXIT_CONFIG, run_until_signalled

    module = builder(service)
    if hasattr(module, "run"):  # not a gRPC service built here (the run-controller's operator)
        return int(module.run(args))
    if not args.port:
        args.port = module.DEFAULT_PORT
    use_tls_flags(args)
    done = threading.Event()
    handle: list[Any] = []

    def start() -> Any:
        handle.append(module.build(args, done))
        return handle[0]

    code = run_until_signalled(service, start, args.metrics_port, done)
    if handle and getattr(handle[0], "config_error", False):
        return EXIT_CONFIG
    return 1 if handle and getattr(handle[0], "failed", False) else code


def main(service: str, argv: list[str] | None = None) -> int:
    """`python -m overworld.SERVICE`: the same flags and code as `overworld serve SERVICE`, on loopback
    and without a metrics port by default."""
    package = MODULES[service].rsplit(".", 1)[1]
    args = parse(service, sys.argv[1:] if argv is None else argv, f"python -m overworld.{package}", local=True)
    return serve(service, args)


class _Builders(Mapping[str, Callable[[argparse.Namespace, threading.Event], Any]]):
    """service -> its build(args, done), imported when asked for (tests assemble services in-process)."""

    def __getitem__(self, service: str) -> Callable[[argparse.Namespace, threading.Event], Any]:
        module = builder(service)
        if not hasattr(module, "build"):
            raise KeyError(service)
        return module.build

    def __iter__(self) -> Iterator[str]:
        return iter(name for name in MODULES if name != "run-controller")

    def __len__(self) -> int:
        return len(MODULES) - 1


BUILDERS = _Builders()


class Served:
    """A gRPC server and what closes with it."""

    def __init__(self, server: Any, *closers: Callable[[], Any]) -> None:
        self.server = server
        self.closers = closers

    def stop(self, grace: float = 5.0) -> None:
        for closer in self.closers:
            closer()
        self.server.stop(grace)
