"""Ctrl-C on `make run` stops the run as the user means it: the services stop, the summary says
"interrupted", no process is left behind, and make prints no `*** [Makefile:NN: run] Error` line as
if the run had failed.

The slow test types Ctrl-C into a real terminal (a pseudo-terminal whose session `make run` leads),
so the kernel sends SIGINT to the whole foreground process group: make, the recipe's shell and
`overworld run`, as a terminal does. GNU make, interrupted itself, waits for its recipe and then ends
by SIGINT (the shell's `$?` is 130, and `make run && next` stops there): that is an interruption, not
an error, and make prints nothing for it when the recipe succeeded. The fast tests check the recipe's
exit statuses with a stand-in `overworld` (130, interrupted, is success; a failure stays one) and the
CLI's own."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pty
import re
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from overworld import cli
from overworld.launch.processes import descendants, proc_stat

ROOT = Path(__file__).resolve().parents[2]
MAKE_ERROR = re.compile(r"^make(\[\d+\])?: \*\*\*", re.MULTILINE)


def _stamp(venv: Path) -> Path:
    """The Makefile's install stamp for `venv` (its name hashes pyproject.toml)."""
    return venv / f".installed-{hashlib.sha1((ROOT / 'pyproject.toml').read_bytes()).hexdigest()[:12]}"


def _fake_venv(tmp_path: Path, exit_code: int) -> Path:
    """A VENV whose `overworld` records its arguments and exits `exit_code`; its stamp is current, so
    make installs nothing."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    script = venv / "bin" / "overworld"
    script.write_text(f'#!/bin/sh\necho "$@" > "{tmp_path / "args"}"\nexit {exit_code}\n')
    script.chmod(0o755)
    _stamp(venv).touch()
    return venv


@pytest.mark.parametrize(("run_exit", "make_exit"), [(0, 0), (130, 0), (1, 2), (2, 2)])
def test_the_recipe_takes_an_interrupted_run_for_success(tmp_path: Path, run_exit: int, make_exit: int) -> None:
    venv = _fake_venv(tmp_path, run_exit)
    result = subprocess.run(["make", "--no-print-directory", "run", f"VENV={venv}", "CONFIG=my.yaml",
                             f"SUMMARY={tmp_path / 's.json'}", "RUN_FLAGS=--workdir w --insecure"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == make_exit, result.stdout + result.stderr
    assert bool(MAKE_ERROR.search(result.stderr)) == (make_exit != 0), result.stderr
    assert (tmp_path / "args").read_text().split() == ["run", "my.yaml", "--summary", str(tmp_path / "s.json"),
                                                       "--workdir", "w", "--insecure"]


def test_the_cli_exits_130_when_interrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    import overworld.launch.run as launch_run

    def interrupted(*_: Any, **__: Any) -> dict[str, Any]:
        return {"status": "interrupted"}

    def failed(*_: Any, **__: Any) -> dict[str, Any]:
        return {"status": "failed"}

    def before_the_services(*_: Any, **__: Any) -> dict[str, Any]:
        raise KeyboardInterrupt

    for fake, code in ((interrupted, cli.EXIT_INTERRUPTED), (failed, 1), (before_the_services, 130)):
        monkeypatch.setattr(launch_run, "run", fake)
        assert cli.main(["run", "x.yaml"]) == code
    assert cli.EXIT_INTERRUPTED == 128 + signal.SIGINT


class Terminal:
    """`make ...` as the leader of a new session on a pseudo-terminal, as a terminal window starts it."""

    def __init__(self, argv: list[str]) -> None:
        master, slave = pty.openpty()
        self.master, self.output = master, b""

        def controlling_terminal() -> None:  # after setsid (start_new_session): this tty is the session's
            import fcntl
            import termios

            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # A terminal's shell starts its foreground job with Ctrl-C's default action, whatever this
            # process inherited: a test before this one may leave SIGINT ignored in pytest, and make
            # started with it ignored stays ignorant of Ctrl-C (it then exits 0 after the run's 130).
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen(argv, cwd=ROOT, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                                     preexec_fn=controlling_terminal,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "OVERWORLD_LOG_FORMAT": "text"})
        os.close(slave)

    def read(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: every process of the session closed the terminal
                    time.sleep(0.1)
                    continue
                self.output += data

    def ctrl_c(self) -> None:
        os.write(self.master, b"\x03")  # the line discipline sends SIGINT to the foreground process group

    def text(self) -> str:
        return self.output.decode(errors="replace").replace("\r\n", "\n")

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.master)


@pytest.mark.slow
def test_ctrl_c_on_make_run_stops_the_run_without_an_error(tmp_path: Path) -> None:
    if not _stamp(ROOT / ".venv").exists():
        pytest.skip("`make run` would install the venv first (make install)")
    summary, workdir = tmp_path / "summary.json", tmp_path / "run"
    terminal = Terminal(["make", "--no-print-directory", "run", "CONFIG=examples/cartpole.yaml",
                         f"SUMMARY={summary}", f"RUN_FLAGS=--workdir {workdir}"])
    try:
        deadline = time.monotonic() + 240
        needed = {"rollout_manager_started", "model_registry_started", "replay_buffer_started", "gae_started",
                  "trainer_started", "worker_registered"}
        while True:  # up: every service serving and a worker registered (the run's status.json)
            terminal.read(0.5)
            with contextlib.suppress(OSError, ValueError):
                if needed <= json.loads((workdir / "status.json").read_text()).get("milestones", {}).keys():
                    break
            assert terminal.proc.poll() is None and time.monotonic() < deadline, terminal.text()[-3000:]
        family = descendants(terminal.proc.pid)  # the shell, overworld, its services and their processes
        assert len(family) >= 7, family
        terminal.ctrl_c()
        while terminal.proc.poll() is None:
            terminal.read(0.5)
            assert time.monotonic() < deadline + 300, terminal.text()[-3000:]
        terminal.read(0.5)
    finally:
        terminal.close()
    out = terminal.text()
    # make was interrupted too: it waited for the run, then ended by SIGINT, as GNU make does, and
    # printed no "*** ... Error" (or "Interrupt") line, since the recipe succeeded
    assert terminal.proc.returncode == -signal.SIGINT, out[-3000:]
    assert not MAKE_ERROR.search(out), out[-3000:]
    assert "interrupted: stopping services" in out and '"status": "interrupted"' in out, out[-3000:]
    assert json.loads(summary.read_text())["status"] == "interrupted"
    time.sleep(1)
    alive = [pid for pid, started in family
             if (fields := proc_stat(pid)) is not None and fields[19] == started and fields[0] != "Z"]
    assert alive == [], alive
