"""Shared fixtures: free ports, and real servers (redis-server, an S3-protocol server) on loopback,
started per test session and stopped by PID.

`redis-server` and `promtool` are the system's or the project's pinned copies, fetched on first use
(tests/server_binaries.py). Before any test runs, the binaries the selected tests need are located;
one that can be neither found nor fetched ends the session with one message, not an error per test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.support import RedisServer, S3Server, server_binary

# Ray started by tests stays on loopback (read by Ray when it is imported).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def _needs(item: pytest.Item) -> set[str]:
    """The server binaries a test uses, as far as collection tells (server_binary() covers the rest)."""
    needs = set()
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "redis_server" in getattr(item, "fixturenames", ()) or "redis" in params.values():
        needs.add("redis-server")
    if hasattr(getattr(item, "module", None), "promtool"):
        needs.add("promtool")
    return needs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for name in sorted(set().union(*(_needs(item) for item in items))):
        server_binary(name)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


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
