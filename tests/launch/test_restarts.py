"""`overworld run`'s restart policy: any service that dies is started again on its address (at once
after a stable run, with a growing backoff in a crash loop, until a limit), and `overworld status
--workdir` shows the restarts per service."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from overworld.core.config import load_config, to_yaml
from overworld.core.grpc_util import wait_healthy
from overworld.core.security import tls
from overworld.launch.credentials import RunSecurity
from overworld.launch.restarts import RestartPolicy, read_services
from overworld.launch.status import print_status
from overworld.launch.supervisor import Supervisor


def test_backoff_grows_in_a_crash_loop_and_a_stable_run_starts_the_count_again() -> None:
    policy = RestartPolicy(max_restarts=4, stable_seconds=60, backoff_cap=3)
    assert [policy.on_exit("gae", 1, 1.0) for _ in range(5)] == [0.0, 1.0, 2.0, 3.0, None]
    assert policy.on_exit("gae", 1, 61.0) == 0.0  # it ran a while: a crash now and then is not a loop
    assert policy.on_exit("trainer", -9, 1.0) == 0.0  # per service
    for name in ("gae", "gae", "trainer"):
        policy.restarted(name)
    assert policy.totals() == {"gae": 2, "trainer": 1}


@pytest.fixture
def launcher(tmp_path: Path):
    config = load_config({"run_id": "restarts"})
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(config))
    security = RunSecurity.create(tmp_path, config.run_id)  # mutual TLS, as `overworld run`
    tls.use(security.identities["operator"])
    launcher = Supervisor(config, tmp_path, path, security, RestartPolicy(max_restarts=2, backoff_cap=1))
    yield launcher
    launcher.stop()
    tls.reset()


def tls_dir_of(pid: int) -> str:
    environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(tls.TLS_DIR_ENV.encode() + b"="))


def supervise_until(launcher: Supervisor, ready, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, "timed out"
        launcher.supervise()
        time.sleep(0.1)


@pytest.mark.slow
def test_a_killed_service_comes_back_on_its_address_and_status_shows_it(launcher: Supervisor, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    launcher.start("rollout-manager", "--config", str(launcher.config_path))
    launcher.start("gae")
    for name in ("rollout-manager", "gae"):
        launcher.wait(name, 60)
    before = read_services(tmp_path)["services"]["gae"]
    os.kill(before["pid"], signal.SIGKILL)
    supervise_until(launcher, lambda: read_services(tmp_path)["services"]["gae"]["pid"] != before["pid"])
    after = read_services(tmp_path)["services"]["gae"]
    assert after["address"] == before["address"] and after["restarts"] == 1
    assert tls_dir_of(after["pid"]) == str(tmp_path / "tls" / "gae")  # its own identity again
    wait_healthy(after["address"], timeout=60, peer="gae")  # over mutual TLS, as the operator
    assert launcher.restarts == {"gae": 1}
    capsys.readouterr()
    assert print_status("unused:0", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "run restarts: 0 workers" in out
    gae_line = next(line for line in out.splitlines() if line.startswith("gae "))
    assert gae_line.split()[1:4] == [after["address"], str(after["pid"]), "1"]


@pytest.mark.slow
def test_a_crash_loop_backs_off_and_ends_the_run_at_the_limit(launcher: Supervisor, tmp_path: Path) -> None:
    # Its port is taken (a state of the machine, which a restart may heal): it exits 1 at once, every time.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        launcher.start("rollout-manager", "--config", str(tmp_path / "config.yaml"), port=taken.getsockname()[1])
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="rollout-manager exited with code 1, 3 times in a row"):
            supervise_until(launcher, lambda: False)
    assert launcher.restarts == {"rollout-manager": 2}
    assert time.monotonic() - started >= 1.0  # the second restart waited a second


@pytest.mark.slow
def test_a_config_file_that_is_not_there_is_not_restarted(launcher: Supervisor, tmp_path: Path) -> None:
    launcher.start("rollout-manager", "--config", str(tmp_path / "missing.yaml"))
    with pytest.raises(RuntimeError, match="cannot run as configured .*missing.yaml does not exist"):
        supervise_until(launcher, lambda: False)
    assert not launcher.restarts.get("rollout-manager")
