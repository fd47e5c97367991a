"""A run's six gRPC services in one process, each served with its own identity's certificate, for
the security and fuzz tests: real servicers assembled as `overworld serve` assembles them (a real
rollout-worker on CartPole registered with the rollout-manager; the trainer's status service
without Ray).

    python tests/security/services_in_one_process.py TLS_ROOT|- WORKDIR ADDRESSES_JSON

serves until SIGTERM; TLS_ROOT is a directory of write_run_credentials(), `-` for plaintext.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "cartpole.yaml"
SERVICES = ("rollout-manager", "model-registry", "gae", "replay-buffer", "trainer", "rollout-worker")


def _args(service: str, workdir: Path, addresses: dict[str, str]) -> argparse.Namespace:
    from overworld.cli import serve_args

    own = {"rollout-manager": ["--config", str(CONFIG), "--index", "memory", "--fresh-state"],
           "replay-buffer": ["--index", "memory"]}.get(service, [])
    args = serve_args([service, "--host", "127.0.0.1", "--workdir", str(workdir), *own])
    args.port = 0
    for name in ("rollout-manager", "replay-buffer", "gae", "model-registry"):
        if hasattr(args, name.replace("-", "_")):
            setattr(args, name.replace("-", "_"), addresses.get(name, ""))
    return args


def serve_fleet(tls_root: Path | None, workdir: Path) -> tuple[dict[str, str], list]:
    from overworld.core.grpc_util import serve
    from overworld.core.security import tls
    from overworld.serve import BUILDERS
    from overworld.trainer.driver import TrainerStatusService
    from overworld.v1 import trainer_pb2_grpc

    os.environ["OVERWORLD_ENV_BACKEND"] = "inprocess"
    addresses: dict[str, str] = {}
    handles = []
    done = threading.Event()
    for service in SERVICES:
        tls.use(tls_root / service if tls_root else None)  # what this component serves and calls with
        if service == "trainer":
            server = serve([(trainer_pb2_grpc.add_TrainerServicer_to_server, TrainerStatusService(),
                             "overworld.v1.Trainer")])
            handles.append(server)
            addresses[service] = server.address
            continue
        handle = BUILDERS[service](_args(service, workdir, addresses), done)
        handles.append(handle)
        server = getattr(handle, "server")  # noqa: B009 - Served and the worker keep their grpc_util.Server here
        addresses[service] = server.address
    return addresses, handles


def main() -> int:
    tls_root, workdir, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    addresses, handles = serve_fleet(None if tls_root == "-" else Path(tls_root), workdir)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(addresses))
    tmp.replace(out)
    stop.wait()
    for handle in reversed(handles):
        handle.stop(1.0)
    return 0


@dataclass
class Fleet:
    addresses: dict[str, str]
    proc: subprocess.Popen
    credentials: dict[str, Path] | None

    def rss_bytes(self) -> int:
        for line in (Path("/proc") / str(self.proc.pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def start_fleet(tmp: Path, secure: bool = True) -> Iterator[Fleet]:
    """A fleet process with a fresh CA (generator: the fixtures' body)."""
    from overworld.core.security.tls import write_run_credentials
    from tests.support import stop_process

    credentials = write_run_credentials(tmp / "tls", "fleet-run") if secure else None
    out = tmp / "addresses.json"
    log = (tmp / "fleet.log").open("wb")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "services"), str(ROOT)])}
    proc = subprocess.Popen([sys.executable, __file__, str(tmp / "tls") if secure else "-",
                             str(tmp / "work"), str(out)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not out.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the fleet did not start:\n" + (tmp / "fleet.log").read_text()[-3000:])
            time.sleep(0.1)
        yield Fleet(json.loads(out.read_text()), proc, credentials)
    finally:
        stop_process(proc, 20)
        log.close()


if __name__ == "__main__":
    raise SystemExit(main())
