"""Small helpers for tests: free ports, waiting for a listener, stopping a process, is it alive, the
server binaries."""

from __future__ import annotations

import functools
import signal
import subprocess
from pathlib import Path

import pytest

from overworld.core.net import free_port, wait_port  # noqa: F401 (re-exported for tests)
from overworld.server_binaries import ServerBinaryUnavailable, locate


@functools.cache
def server_binary(name: str) -> str:
    """`redis-server` or `promtool`: the system's or the project's pinned copy (fetched once). One
    that cannot be had ends the whole session with this one message: every test after it would fail
    the same way."""
    try:
        return str(locate(name))
    except ServerBinaryUnavailable as err:
        pytest.exit(f"{name} is needed by the selected tests and could not be had: {err}\n"
                    f"Install it (.ci/apt-packages.txt lists Debian's packages) or put it on PATH.", returncode=1)


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
