"""overworld run | serve | status.

`overworld run` exits 0 when the run completed (its budget, its target or all its iterations), 1 when
it failed, 2 for a config it cannot use, and EXIT_INTERRUPTED (130, as a shell reports a command that
SIGINT ended) when Ctrl-C, SIGTERM or SIGHUP stopped it: the services stopped and the summary written,
its status "interrupted" (the Makefile's `run` takes that for success).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from overworld.core.service import env_default

EXIT_INTERRUPTED = 130  # 128 + SIGINT

def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from overworld.serve import MODULES

    p = sub.add_parser("serve", help="run one service (the container entry point)",
                       description="Run one service. `overworld serve SERVICE --help` lists the flags and "
                                   "environment variables SERVICE reads.")
    p.add_argument("service", choices=list(MODULES))
    # Each service parses its own flags (overworld/serve/<service>.py): what is left goes to it.
    p.add_argument("flags", nargs=argparse.REMAINDER, help="SERVICE's flags")


def serve_args(argv: list[str]) -> argparse.Namespace:
    """`overworld serve SERVICE ...`'s flags as parsed (defaults from the environment), for code that
    builds a service in its own process (`overworld.serve.builder`)."""
    from overworld.serve import parse

    service, *flags = argv
    return parse(service, flags)


def use_tls_flags(args: argparse.Namespace, log: bool = True) -> None:
    from overworld.serve import use_tls_flags as use

    use(args, log)


def serve_main(args: argparse.Namespace) -> int:
    from overworld.serve import parse, serve

    return serve(args.service, parse(args.service, args.flags))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="overworld", description="Online RL for Minecraft agents, as services.")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train a task on this machine: every service as its own process")
    r.add_argument("config", help="YAML file, or a .py file defining online_dict (MineStudio style)")
    r.add_argument("--set", action="append", default=[], metavar="dotted.key=value", help="override a config key")
    r.add_argument("--max-env-steps", type=int, default=None)
    r.add_argument("--target-return", type=float, default=None,
                   help="stop once the mean return of the last 100 episodes reaches this")
    r.add_argument("--keep-going", action="store_true",
                   help="with --target-return: note when it is reached (the summary's steps_to_target) and run on "
                        "to --max-env-steps or the last iteration")
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
    from overworld.serve import add_tls_flags

    add_tls_flags(s)
    c = sub.add_parser("certs", help="make a CA and a certificate for every identity of a run (kustomize, "
                                     "hand-started services)")
    c.add_argument("out", help="directory: OUT/<identity>/{tls.crt,tls.key,ca.crt}")
    c.add_argument("--run", required=True, help="the run (release) the certificates belong to")
    c.add_argument("--days", type=int, default=365)
    args = parser.parse_args(argv)

    if args.command == "run":
        from overworld.core.config import ConfigError
        from overworld.launch.run import run

        try:
            if args.keep_going and args.target_return is None:
                raise ConfigError("--keep-going goes with --target-return (the return to note on the way)")
            summary = run(args.config, args.set, args.max_env_steps, args.summary, args.workdir, args.target_return,
                          args.resume, secure=not args.insecure, keep_going=args.keep_going)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # before the services started (run() handles it from then on)
            print("overworld run: interrupted", file=sys.stderr)
            return EXIT_INTERRUPTED
        if summary["status"] == "interrupted":
            return EXIT_INTERRUPTED
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
        from overworld.launch.status import print_status

        if args.workdir and not args.tls_dir and not args.insecure:
            operator = Path(args.workdir, "tls", "operator")
            args.tls_dir = str(operator) if operator.is_dir() else ""
        use_tls_flags(args, log=False)
        return print_status(args.rollout_manager, args.workdir)
    if args.command == "certs":
        from overworld.core.security.tls import write_run_credentials

        for identity, path in write_run_credentials(Path(args.out), args.run, days=args.days).items():
            print(f"{identity:<16} {path}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
