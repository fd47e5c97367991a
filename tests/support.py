"""Small helpers for tests (and benchmarks): free ports, waiting for a listener, stopping a process, is
it alive, the server binaries, and real stores on loopback (redis-server, an S3-protocol server: the
rehearsal's, rehearsal/local_stores.py)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from overworld.core.net import free_port, wait_port  # noqa: F401 (re-exported for tests)
from rehearsal import local_stores
from rehearsal.local_stores import S3Server, stop_process  # noqa: F401 (re-exported for tests)
from rehearsal.server_binaries import ServerBinaryUnavailable, locate


@functools.cache
def server_binary(name: str) -> str:
    """`redis-server`, `promtool` or `prometheus`: the system's or the project's pinned copy (fetched once). One
    that cannot be had ends the whole session with this one message: every test after it would fail
    the same way."""
    try:
        return str(locate(name))
    except ServerBinaryUnavailable as err:
        pytest.exit(f"{name} is needed by the selected tests and could not be had: {err}\n"
                    f"Install it (tests/debian-packages.txt lists Debian's packages; `make test` installs them as root) or put it on PATH.", returncode=1)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (any process, not only our children)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class RedisServer(local_stores.RedisServer):
    """The rehearsal's redis-server on loopback; one that cannot be had ends the session (server_binary)."""

    def __init__(self, workdir: Path, appendonly: bool = True, password: str = "", extra_args: tuple[str, ...] = ()
                 ) -> None:
        super().__init__(workdir, appendonly, password, extra_args, binary=server_binary("redis-server"))


def interrupt_run(config: Path, workdir: Path, when_trainer_logs: str, *flags: str, then_wait: float = 0.0,
                  env: dict[str, str] | None = None, act: Callable[[], None] | None = None, until: str = "") -> str:
    """An `overworld run` of `config` (plaintext), interrupted as Ctrl-C does once its trainer's log says
    `when_trainer_logs` (then `act()`, then until the log also says `until`, then `then_wait` seconds
    more); returns the trainer's log."""
    run = subprocess.Popen(
        [sys.executable, "-m", "overworld.cli", "run", str(config), "--insecure", "--workdir", str(workdir), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    trainer_log = workdir / "logs" / "trainer.log"

    def wait_for(line: str) -> None:
        deadline = time.monotonic() + 240
        while line not in (trainer_log.read_text(errors="replace") if trainer_log.exists() else ""):
            assert run.poll() is None and time.monotonic() < deadline, f"the trainer never logged {line!r}"
            time.sleep(0.5)

    try:
        wait_for(when_trainer_logs)
        if act is not None:
            act()
        if until:
            wait_for(until)
        time.sleep(then_wait)
        run.send_signal(signal.SIGINT)
        assert run.wait(timeout=300) == 130  # interrupted
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    return trainer_log.read_text(errors="replace")
