"""Small helpers for tests: free ports, waiting for a listener, stopping a process."""

from __future__ import annotations

import signal
import subprocess

from overworld.core.net import free_port, wait_port  # noqa: F401 (re-exported for tests)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
