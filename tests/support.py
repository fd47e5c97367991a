"""Small helpers for tests: free ports, waiting for a listener, stopping a process, is it alive."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from overworld.core.net import free_port, wait_port  # noqa: F401 (re-exported for tests)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (any process, not only our children)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
