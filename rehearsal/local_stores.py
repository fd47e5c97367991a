"""Real stores on loopback for the benches and the tests: a `redis-server` (the system's or the project's
pinned copy: server_binaries.py) and moto's S3-protocol server, each on a free port, stopped by PID."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from overworld.core.net import free_port, wait_port
from rehearsal.server_binaries import locate


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _require(binary: str, how: str) -> str:
    """A binary on PATH or in this Python's bin directory (the venv's moto_server)."""
    path = shutil.which(binary) or shutil.which(binary, path=str(Path(sys.executable).parent))
    if path is None:
        raise RuntimeError(f"{binary} is not installed ({how}); `make test` installs it as root (tests/debian-packages.txt)")
    return path


class RedisServer:
    def __init__(self, workdir: Path, appendonly: bool = True, password: str = "", extra_args: tuple[str, ...] = (),
                 binary: str | None = None) -> None:
        self.binary = binary or str(locate("redis-server"))  # ServerBinaryUnavailable: neither found nor fetched
        self.workdir = workdir
        self.port = free_port()
        self.appendonly = appendonly
        self.password = password
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                "--protected-mode", "no", *(["--requirepass", self.password] if self.password else []),
                *self.extra_args]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def aof_commands(self) -> list[list[bytes]]:
        """Every write Redis made durable, in order, read from its append-only files (Redis 7: the
        incremental files of appendonlydir; start it with `--auto-aof-rewrite-percentage 0`, or a
        rewrite folds the history into a snapshot). A script's writes appear as the commands it ran."""
        out: list[list[bytes]] = []
        for path in sorted((self.workdir / "appendonlydir").glob("*.incr.aof"),
                           key=lambda p: int(p.name.split(".")[-3])):
            data = path.read_bytes()
            i = 0
            while i < len(data):
                end = data.index(b"\r\n", i)
                assert data[i:i + 1] == b"*", f"{path}: expected a command, found {data[i:i + 20]!r}"
                count, i = int(data[i + 1:end]), end + 2
                args = []
                for _ in range(count):
                    end = data.index(b"\r\n", i)
                    size, i = int(data[i + 1:end]), end + 2  # $<length>
                    args.append(data[i:i + size])
                    i += size + 2
                out.append(args)
        return out

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            if kill:
                self.proc.kill()
                self.proc.wait()
            else:
                stop_process(self.proc)
            self.proc = None


class S3Server:
    """moto's S3-protocol server on a free loopback port. It keeps its objects in memory: `pause()`
    (SIGSTOP) makes it unreachable without losing them, as an S3 outage would."""

    def __init__(self) -> None:
        self.binary = _require("moto_server", "PyPI moto[server], in the dev extra")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """The OVERWORLD_S3_* settings."""
        return {"OVERWORLD_S3_ENDPOINT": f"http://127.0.0.1:{self.port}", "OVERWORLD_S3_ACCESS_KEY": "testing",
                "OVERWORLD_S3_SECRET_KEY": "testing"}

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()
            stop_process(self.proc)
            self.proc = None
