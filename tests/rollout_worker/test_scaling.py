"""Scaling as `kubectl scale` does it, against a real `overworld run` (every service its own
process, Ray trainer): a second worker started mid-run with `overworld serve rollout-worker` joins
(fleet of 2, its fragments reach the buffer while training goes on), then leaves on SIGTERM
without stalling training; `overworld status` shows the fleet both times."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from overworld.core.security import tls
from overworld.rollout_manager.client import RolloutManagerClient
from overworld.trainer.client import TrainerClient
from tests.rollout_worker.test_worker import wait_for
from tests.support import free_port, stop_process, wait_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_second_worker_joins_and_leaves_mid_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OVERWORLD_LOG_FORMAT": "text"}
    run = subprocess.Popen([sys.executable, "-m", "overworld.cli", "run", str(ROOT / "examples/cartpole.yaml"),
                            "--max-env-steps", "50000000", "--workdir", str(tmp_path / "run"),
                            "--summary", str(tmp_path / "summary.json")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(run.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    second = None
    try:
        def address(name: str) -> str | None:
            for line in list(lines):
                m = re.match(rf"\s+{re.escape(name)}\s+(\S+)\s+pid", line)
                if m:
                    return m.group(1)
            return None

        wait_for(lambda: all(address(n) for n in ("rollout-manager", "replay-buffer", "model-registry", "trainer",
                                                   "rollout-worker#0")) or run.poll() is not None, 120, "services")
        assert run.poll() is None, "".join(lines)[-3000:]
        certificates = tmp_path / "run" / "tls"  # the run's mutual TLS: join it as its identities do
        tls.use(certificates / "operator")
        manager = RolloutManagerClient(address("rollout-manager"))  # type: ignore[arg-type]
        trainer = TrainerClient(address("trainer"))  # type: ignore[arg-type]

        def updates() -> int:
            try:
                return trainer.status(timeout=5).updates
            except Exception:  # noqa: BLE001 - still starting
                return 0

        wait_for(lambda: updates() > 0, 240, "the trainer's first update")
        port = free_port()
        second = subprocess.Popen(
            [sys.executable, "-m", "overworld.cli", "serve", "rollout-worker", "--host", "127.0.0.1", "--port",
             str(port), "--metrics-port", "0", "--rollout-manager", address("rollout-manager"),
             "--replay-buffer", address("replay-buffer"), "--model-registry", address("model-registry")],
            stdout=open(tmp_path / "second.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
            env={**env, tls.TLS_DIR_ENV: str(certificates / "rollout-worker")})
        wait_port(port, 60)
        addr = f"127.0.0.1:{port}"

        def mine():  # type: ignore[no-untyped-def]
            return next((w for w in manager.fleet_status().workers if w.address == addr), None)

        wait_for(lambda: len(manager.fleet_status().workers) == 2 and mine() is not None
                 and mine().fragments_sent >= 20, 120, "the second worker to join and have 20 fragments acknowledged")
        status = subprocess.run([sys.executable, "-m", "overworld.cli", "status", "--rollout-manager",
                                 address("rollout-manager"), "--tls-dir", str(certificates / "operator")],
                                capture_output=True, text=True, env=env, timeout=30)
        assert status.returncode == 0 and ": 2 workers" in status.stdout and addr in status.stdout, status.stdout
        before = updates()
        wait_for(lambda: updates() > before + 2, 120, "training to go on with two workers")
        stop_process(second, 60)
        assert second.returncode == 0
        wait_for(lambda: len(manager.fleet_status().workers) == 1, 30, "the fleet to shrink to one worker")
        left = updates()
        wait_for(lambda: updates() > left + 2, 120, "training to go on after the second worker left")
        assert run.poll() is None
        # Ctrl-C stops the run gracefully, even when it was started with SIGINT ignored (as a shell
        # starts a background command; pytest may run so)
        os.killpg(run.pid, signal.SIGINT)
        run.wait(300)
        assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"
    finally:
        tls.reset()
        if second is not None and second.poll() is None:
            second.kill()
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGINT)
            try:
                run.wait(300)  # the launcher's graceful stop: workers 40 s, trainer 150 s, the rest 40 s
            except subprocess.TimeoutExpired:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    reader.join(5)
    time.sleep(0.5)
