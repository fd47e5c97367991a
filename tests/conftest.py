"""Shared fixtures: free ports, and real servers (redis-server, an S3-protocol server) on loopback,
started per test session and stopped by PID; the images built here (`image_store`).

`redis-server`, `promtool` and `prometheus` are the system's or the project's pinned copies, fetched on first use
(rehearsal/server_binaries.py). Before any test runs, the binaries the selected tests need are located;
one that can be neither found nor fetched ends the session with one message, not an error per test.
Likewise for the image tests and the cluster rehearsal: what they need of the machine (root, an image
builder, nft, ...) is checked, and the images are built (rehearsal/oci_images.py; layers cached across
runs, OVERWORLD_SKIP_IMAGE_BUILD=1 uses them as they are), before any test runs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rehearsal import oci_images
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
    if "rehearsal" in getattr(item, "fixturenames", ()):  # a real Prometheus watches the rehearsal
        needs.add("prometheus")
    return needs


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` have deselected: only what will run is prepared
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for name in sorted(set().union(*(_needs(item) for item in items))):
        server_binary(name)
    _prepare_images(config, items)


def _prepare_images(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The machine checked for what the selected image tests and network-namespace tests need, then the
    images built: what is missing, or a build that fails, ends the session with one message."""
    images = any("image_store" in getattr(item, "fixturenames", ()) for item in items)
    namespaces = any(Path(str(item.path)).is_relative_to(REHEARSAL_TESTS) for item in items)
    if not images and not namespaces:
        return
    missing = oci_images.missing_prerequisites(images=images, namespaces=namespaces)
    if missing:
        pytest.exit(f"the selected tests (image tests, tests/rehearsal) need what this machine lacks: {'; '.join(missing)}."
                    " `make test` installs it all as root (tests/debian-packages.txt); or leave them out:"
                    " --ignore=tests/rehearsal --ignore=tests/images", returncode=1)
    if not images or config.option.collectonly or os.environ.get("OVERWORLD_SKIP_IMAGE_BUILD") == "1":
        return
    log = oci_images.REPO / "output" / "image-build.log"
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"building the images the tests run (make rehearsal-images, cached layers); log: {log}")
    try:
        oci_images.build(log)
    except oci_images.ImageBuildFailed as err:
        pytest.exit(f"the images could not be built: {err}", returncode=1)


REHEARSAL_TESTS = Path(__file__).parent / "rehearsal"


@pytest.fixture(scope="session")
def image_store() -> Iterator[oci_images.ImageStore]:
    """The images `make rehearsal-images` built (their configs and root filesystems)."""
    store = oci_images.ImageStore.here()
    try:
        yield store
    finally:
        store.close()


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
