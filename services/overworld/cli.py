"""overworld run | serve | status."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from overworld.core.service import env_default


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from overworld.services import BUILDERS, add_registry_flags

    p = sub.add_parser("serve", help="run one service (the container entry point)")
    p.add_argument("service", choices=[*BUILDERS, "run-controller"])
    p.add_argument("--host", default=env_default("host", "0.0.0.0"))
    p.add_argument("--port", type=int, default=env_default("port", 0), help="gRPC port (default: the service's)")
    p.add_argument("--metrics-port", type=int, default=env_default("metrics-port", 9090))
    p.add_argument("--config", default=env_default("config", ""))
    p.add_argument("--set", action="append", default=[], metavar="dotted.key=value")
    p.add_argument("--rollout-manager", default=env_default("rollout-manager", "127.0.0.1:50051"))
    p.add_argument("--replay-buffer", default=env_default("replay-buffer", "127.0.0.1:50052"))
    p.add_argument("--gae", default=env_default("gae", "127.0.0.1:50053"))
    p.add_argument("--model-registry", default=env_default("model-registry", "127.0.0.1:50054"))
    p.add_argument("--index", default=env_default("index", ""))
    p.add_argument("--blobs", default=env_default("blobs", ""))
    p.add_argument("--ray-address", default=env_default("ray-address", ""))
    p.add_argument("--resume", default=env_default("resume", ""))
    p.add_argument("--save-path", default=env_default("save-path", ""))
    p.add_argument("--workdir", default=env_default("workdir", "."))
    p.add_argument("--retain", type=int, default=env_default("retain", 20))
    p.add_argument("--lease-seconds", type=float, default=env_default("lease-seconds", 15.0))
    p.add_argument("--flush-timeout", type=float, default=env_default("flush-timeout", 30.0),
                   help="rollout-worker: seconds its stop waits for the replay buffer to take what it holds")
    p.add_argument("--fresh-state", action="store_true", default=env_default("fresh-state", False),
                   help="rollout-manager: start a new fleet (counters from zero) instead of restoring the saved one")
    add_registry_flags(p)
    _tls_flags(p)


def serve_args(argv: list[str]) -> argparse.Namespace:
    """`overworld serve SERVICE ...`'s flags as parsed (defaults from the environment), for code that
    builds a service in its own process (services.BUILDERS)."""
    parser = argparse.ArgumentParser(prog="overworld")
    _serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def _tls_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-dir", default=env_default("tls-dir", ""),
                   help="this process's identity: a directory with tls.crt, tls.key and ca.crt (mutual TLS)")
    p.add_argument("--insecure", action="store_true", default=env_default("insecure", False),
                   help="plaintext gRPC, no authorization: for debugging only")


def use_tls_flags(args: argparse.Namespace, log: bool = True) -> None:
    """--tls-dir / --insecure to this process's credentials (core/tls.py), through the environment so
    that what it starts (the trainer's Ray workers) has the same identity."""
    import logging
    import os

    from overworld.core import tls

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


def serve_main(args: argparse.Namespace) -> int:
    from overworld.core.service import EXIT_CONFIG, run_until_signalled
    from overworld.services import BUILDERS, DEFAULT_PORTS

    if args.service == "run-controller":
        from overworld.run_controller import main as controller_main

        return controller_main([])
    if not args.port:
        args.port = DEFAULT_PORTS[args.service]
    use_tls_flags(args)
    done = threading.Event()
    handle: list = []

    def start():  # type: ignore[no-untyped-def]
        handle.append(BUILDERS[args.service](args, done))
        return handle[0]

    code = run_until_signalled(args.service, start, args.metrics_port, done)
    if handle and getattr(handle[0], "config_error", False):
        return EXIT_CONFIG
    return 1 if handle and getattr(handle[0], "failed", False) else code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overworld", description="Online RL for Minecraft agents, as services.")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train a task on this machine: every service as its own process")
    r.add_argument("config", help="YAML file, or a .py file defining online_dict (MineStudio style)")
    r.add_argument("--set", action="append", default=[], metavar="dotted.key=value", help="override a config key")
    r.add_argument("--max-env-steps", type=int, default=None)
    r.add_argument("--target-return", type=float, default=None,
                   help="stop once the mean return of the last 100 episodes reaches this")
    r.add_argument("--summary", default=None, help="write the JSON run summary here")
    r.add_argument("--workdir", default=None, help="default: runs/<run_id>")
    r.add_argument("--resume", default=None, metavar="latest|CHECKPOINT_ID",
                   help="continue the run in --workdir from a checkpoint")
    r.add_argument("--insecure", action="store_true",
                   help="no certificates: plaintext gRPC and no authorization between the services (debugging)")
    _serve_parser(sub)
    e = sub.add_parser("export-minestudio", help="write an Overworld checkpoint as one MineStudio's PPOTrainer resumes")
    e.add_argument("checkpoint", help="a local checkpoint directory: <save_path>/<run_id>/checkpoints/iter-N")
    e.add_argument("out", help="directory for model.ckpt, optimizer.ckpt (scaler.ckpt) and whole_config.pkl")
    s = sub.add_parser("status", help="print the fleet status of a running run")
    s.add_argument("--rollout-manager", default=env_default("rollout-manager", "127.0.0.1:50051"))
    s.add_argument("--workdir", default=None,
                   help="the workdir of an `overworld run`: its services, their restarts, and its rollout-manager "
                        "(as the run's operator, <workdir>/tls/operator, unless --tls-dir or --insecure)")
    _tls_flags(s)
    c = sub.add_parser("certs", help="make a CA and a certificate for every identity of a run (kustomize, "
                                     "hand-started services)")
    c.add_argument("out", help="directory: OUT/<identity>/{tls.crt,tls.key,ca.crt}")
    c.add_argument("--run", required=True, help="the run (release) the certificates belong to")
    c.add_argument("--days", type=int, default=365)
    args = parser.parse_args(argv)

    if args.command == "run":
        from overworld.core.config import ConfigError
        from overworld.launcher import run

        try:
            summary = run(args.config, args.set, args.max_env_steps, args.summary, args.workdir, args.target_return,
                          args.resume, secure=not args.insecure)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0 if summary["status"] in ("completed", "target_reached", "max_env_steps") else 1
    if args.command == "serve":
        return serve_main(args)
    if args.command == "export-minestudio":
        from overworld.trainer.minestudio_checkpoint import export_checkpoint

        try:
            print(export_checkpoint(args.checkpoint, args.out))
        except (ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "status":
        from overworld.status import print_status

        if args.workdir and not args.tls_dir and not args.insecure:
            operator = Path(args.workdir, "tls", "operator")
            args.tls_dir = str(operator) if operator.is_dir() else ""
        use_tls_flags(args, log=False)
        return print_status(args.rollout_manager, args.workdir)
    if args.command == "certs":
        from overworld.core.tls import write_run_credentials

        for identity, path in write_run_credentials(Path(args.out), args.run, days=args.days).items():
            print(f"{identity:<16} {path}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
