"""A service started by `overworld run` stops when the launcher dies, even by SIGKILL: nothing is
left running as an orphan (real processes: a launcher starting a real gae service)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import alive, free_port, stop_process, wait_port

ROOT = Path(__file__).resolve().parents[2]

LAUNCHER = """
import sys, time
from pathlib import Path
from overworld.core.config import load_config
from overworld.launcher import Launcher
launcher = Launcher(load_config(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[1]))
child = launcher.start("gae", port=int(sys.argv[3]))
print("SERVICE", child.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_service_stops_when_its_launcher_is_killed(tmp_path: Path) -> None:
    port = free_port()
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(ROOT / "examples/cartpole.yaml"), str(tmp_path),
                                 str(port)], stdout=subprocess.PIPE, text=True)
    service = 0
    try:
        for line in launcher.stdout:  # type: ignore[union-attr]
            if line.startswith("SERVICE"):
                service = int(line.split()[1])
                break
        assert service, "the launcher did not start the service"
        wait_port(port, 60)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        deadline = time.monotonic() + 60
        while alive(service) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(service), "the service outlived its launcher"
        log = (tmp_path / "logs" / "gae.log").read_text()
        assert "received SIGTERM" in log and "stopped cleanly" in log, log[-2000:]
    finally:
        stop_process(launcher)
        if service and alive(service):
            os.kill(service, signal.SIGKILL)
