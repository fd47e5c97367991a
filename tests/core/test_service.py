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
from overworld.launch.supervisor import Supervisor
launcher = Supervisor(load_config(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[1]))
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


SIGNALLED_ON_ANOTHER_THREAD = """
import signal, sys, threading, time
from overworld.core.service import run_until_signalled

class Handle:
    def stop(self, grace):
        pass

def start():
    def later():
        time.sleep(0.5)
        # as the kernel may do with a process-directed SIGTERM: delivered to a gRPC or worker thread
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    threading.Thread(target=later, daemon=True).start()
    return Handle()

sys.exit(run_until_signalled("probe", start, 0))
"""


def test_a_signal_delivered_to_another_thread_stops_the_service() -> None:
    """Python runs signal handlers on the main thread only: a main thread blocked in a wait without
    timeout never sees a SIGTERM the kernel handed to another thread (a launcher's SIGKILL then left
    the service running: its PR_SET_PDEATHSIG SIGTERM went to a gRPC thread)."""
    env = {**os.environ, "OVERWORLD_LOG_FORMAT": "text"}
    try:
        done = subprocess.run([sys.executable, "-c", SIGNALLED_ON_ANOTHER_THREAD], capture_output=True, text=True,
                              timeout=30, env=env)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"the service did not stop on SIGTERM: {err.stderr!r}") from None
    assert done.returncode == 0 and "received SIGTERM" in done.stderr and "stopped cleanly" in done.stderr, done.stderr
