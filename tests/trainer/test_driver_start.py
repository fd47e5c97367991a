"""The trainer's start cost is paid early: `overworld serve trainer` starts Ray the moment the run config
says it needs one, while it still waits to publish its first version; in Ray Train's local mode it
starts none. And a SIGTERM after Ray started lets the driver finish its stop."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from overworld.launch.processes import descendants, kill_if_same
from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]


def wait_for_ray(proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    """Until the driver logs that Ray started; fails if it exits or takes longer."""
    deadline = time.monotonic() + timeout
    while "Ray started in" not in log.read_text(errors="replace"):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"Ray did not start within {timeout:.0f} s:\n" + log.read_text()[-3000:]
        time.sleep(0.5)


def start_driver(tmp_path: Path, num_workers: int, *extra: str) -> tuple[subprocess.Popen, subprocess.Popen, Path]:
    """A rollout-manager serving examples/cartpole.yaml with `num_workers`, and a driver that asks it for
    the config; no model registry listens, so the driver cannot publish its first version."""
    config = tmp_path / "config.yaml"
    config.write_text((ROOT / "examples" / "cartpole.yaml").read_text().replace(
        "num_workers: 0", f"num_workers: {num_workers}"))
    manager_port, nobody = free_port(), free_port()
    env = {**os.environ, "OVERWORLD_LOG_FORMAT": "text", "PYTHONUNBUFFERED": "1"}
    manager = subprocess.Popen(
        [sys.executable, "-m", "overworld.cli", "serve", "rollout-manager", "--host", "127.0.0.1", "--port",
         str(manager_port), "--metrics-port", "0", "--config", str(config), "--workdir", str(tmp_path / "manager"),
         "--fresh-state"], stdout=(tmp_path / "manager.log").open("wb"), stderr=subprocess.STDOUT, env=env)
    log = tmp_path / "trainer.log"
    driver = subprocess.Popen(
        [sys.executable, "-m", "overworld.cli", "serve", "trainer", "--host", "127.0.0.1", "--port", str(free_port()),
         "--metrics-port", "0", "--rollout-manager", f"127.0.0.1:{manager_port}", "--model-registry",
         f"127.0.0.1:{nobody}", "--workdir", str(tmp_path / "trainer"), *extra],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    return manager, driver, log


def stop_all(*procs: subprocess.Popen, family: list[tuple[int, str]]) -> None:
    for proc in procs:
        proc.kill()
        proc.wait()
    for pid, started in family:
        kill_if_same(pid, started)


@pytest.mark.slow
def test_ray_starts_as_soon_as_the_config_asks_for_it_while_the_first_version_waits(tmp_path: Path) -> None:
    """The start cost is paid early: Ray starts in the background the moment the run config says it
    is needed (num_workers >= 1), while the driver still waits to publish its first version (here no
    model registry is up at all)."""
    manager, driver, log = start_driver(tmp_path, num_workers=1)
    family: list[tuple[int, str]] = []
    try:
        wait_for_ray(driver, log)
        assert driver.poll() is None
        assert "published the starting weights" not in log.read_text(errors="replace")
        family = descendants(driver.pid)
    finally:
        stop_all(driver, manager, family=family or descendants(driver.pid))


@pytest.mark.slow
def test_local_mode_starts_no_ray(tmp_path: Path) -> None:
    """num_workers: 0 is Ray Train's local mode: the learner trains in the driver's process, and no
    Ray process is started at all (the ~20 s and half-dozen processes a laptop's 2 cores pay for)."""
    manager, driver, log = start_driver(tmp_path, num_workers=0)
    family: list[tuple[int, str]] = []
    try:
        deadline = time.monotonic() + 120
        while "Ray Train's local mode" not in log.read_text(errors="replace"):
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.5)
        time.sleep(5)  # a Ray start would have spawned its gcs_server and raylet by now
        family = descendants(driver.pid)
        assert driver.poll() is None
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    for pid, _ in family if Path(f"/proc/{pid}/cmdline").exists()]
        assert not [c for c in commands if "ray" in c.lower()], commands
        assert "Ray started in" not in log.read_text(errors="replace")
    finally:
        stop_all(driver, manager, family=family or descendants(driver.pid))


@pytest.mark.slow
def test_local_mode_on_a_ray_cluster_is_refused(tmp_path: Path) -> None:
    """With --ray-address (the RayJob on KubeRay) num_workers: 0 would train on the head pod: refused, with
    the exit code that tells `overworld run` and the RayJob not to try again. At once: not after the
    first version's publish has waited out its 60 s for a registry (none listens here)."""
    from overworld.core.service import EXIT_CONFIG

    manager, driver, log = start_driver(tmp_path, 0, "--ray-address", f"127.0.0.1:{free_port()}")
    try:
        assert driver.wait(40) == EXIT_CONFIG, log.read_text(errors="replace")[-3000:]
        assert "give num_workers >= 1 there" in log.read_text(errors="replace")
    finally:
        stop_all(driver, manager, family=[])


STOPPING_DRIVER = """
import threading
import time

from overworld.core.service import run_until_signalled
from overworld.trainer.driver import keep_ray_until_released, start_ray


class WaitsForTheCheckpoint:
    \"\"\"Ray in a thread of its own that holds it until the stop lets it go, as TrainerDriver does.\"\"\"

    def __init__(self) -> None:
        self.released = threading.Event()
        self.thread = threading.Thread(target=self.train, daemon=True)
        self.thread.start()

    def train(self) -> None:
        start_ray("")
        keep_ray_until_released(self.released)

    def stop(self, grace: float) -> None:
        time.sleep(4)  # the driver waits for rank 0 to checkpoint after its iteration
        print("the checkpoint wait is over", flush=True)
        self.released.set()
        self.thread.join(60)


raise SystemExit(run_until_signalled("trainer", WaitsForTheCheckpoint, 0))
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
