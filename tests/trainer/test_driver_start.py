"""The trainer's start cost is paid early: `overworld serve trainer` starts Ray the moment it starts,
while the rollout-manager it needs is not even up (under `overworld run` every service starts at once)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overworld.launcher import descendants, kill_if_same
from tests.support import free_port


def wait_for_ray(proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    """Until the driver logs that Ray started; fails if it exits or takes longer."""
    deadline = time.monotonic() + timeout
    while "Ray started in" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"Ray did not start within {timeout:.0f} s:\n" + log.read_text()[-3000:]
        time.sleep(0.5)


@pytest.mark.slow
def test_ray_starts_before_the_rollout_manager_answers(tmp_path: Path) -> None:
    nobody = free_port()  # no rollout-manager listens here: the driver keeps asking for the run config
    log = tmp_path / "trainer.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "overworld.cli", "serve", "trainer", "--host", "127.0.0.1", "--port", str(free_port()),
         "--metrics-port", "0", "--rollout-manager", f"127.0.0.1:{nobody}", "--workdir", str(tmp_path)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "OVERWORLD_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1"})
    family: list[tuple[int, str]] = []
    try:
        wait_for_ray(proc, log)
        assert proc.poll() is None  # still waiting for the rollout-manager
        family = descendants(proc.pid)
    finally:
        family = family or descendants(proc.pid)
        proc.kill()
        proc.wait()
        for pid, started in family:
            kill_if_same(pid, started)


STOPPING_DRIVER = """
import threading
import time

from overworld.core.service import run_until_signalled
from overworld.trainer.service import start_ray


class WaitsForTheCheckpoint:
    def stop(self, grace: float) -> None:
        time.sleep(4)  # the driver waits for rank 0 to checkpoint after its iteration
        print("the checkpoint wait is over", flush=True)


def start() -> WaitsForTheCheckpoint:
    threading.Thread(target=start_ray, args=("",), daemon=True).start()  # as the driver does: another thread
    return WaitsForTheCheckpoint()


raise SystemExit(run_until_signalled("trainer", start, 0))
"""


@pytest.mark.slow
def test_sigterm_after_ray_started_lets_the_driver_finish_its_stop(tmp_path: Path) -> None:
    """Ray's failure-signal handler, installed in the driver by ray.init, turned SIGTERM into an abort
    about two seconds later: a driver waiting for rank 0's checkpoint died without it (kubectl resume,
    a drained head pod), and Ray then waited out RAY_JOB_STOP_WAIT_TIME_S for it."""
    script, log = tmp_path / "driver.py", tmp_path / "driver.log"
    script.write_text(STOPPING_DRIVER)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OVERWORLD_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1"})
    family: list[tuple[int, str]] = []
    try:
        wait_for_ray(proc, log)
        family = descendants(proc.pid)
        proc.terminate()
        code = proc.wait(120)
        out = log.read_text(errors="replace")
        assert code == 0, out[-3000:]
        assert "the checkpoint wait is over" in out and "trainer stopped cleanly" in out, out[-3000:]
    finally:
        family = family or descendants(proc.pid)
        proc.kill()
        proc.wait()
        for pid, started in family:
            kill_if_same(pid, started)
