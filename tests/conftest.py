"""Shared fixtures: free ports, and real servers (redis-server, an S3-protocol server) on loopback,
started per test session and stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import free_port, stop_process, wait_port

# Ray started by tests stays on loopback (read by Ray when it is imported).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def _require(binary: str, how: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.fail(f"{binary} is not installed ({how}); .ci/run installs it")
    return path


class RedisServer:
    def __init__(self, workdir: Path, appendonly: bool = True) -> None:
        self.binary = _require("redis-server", "Debian package redis-server")
        self.workdir = workdir
        self.port = free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
                "--protected-mode", "no"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)

    def stop(self, kill: bool = False) -> None:
        if self.proc is not None:
            if kill:
                self.proc.kill()
                self.proc.wait()
            else:
                stop_process(self.proc)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


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


@pytest.fixture(scope="session")
def s3_server() -> Iterator[dict[str, str]]:
    """moto's S3-protocol server on a free loopback port; yields the OVERWORLD_S3_* settings."""
    server = S3Server()
    try:
        server.start()
        yield server.env
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for key, value in s3_server.items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # gRPC honours http_proxy; loopback traffic must never go through one.
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    os.environ.setdefault("OVERWORLD_LOG_FORMAT", "text")
