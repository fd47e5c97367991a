"""A machine without what the image tests and the cluster rehearsal need (an image builder, nft, ...):
the test run stops before any test runs, with one line naming what is missing and how to get it;
never an error per test, never a silent pass (tests/conftest.py, rehearsal/oci_images.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HIDDEN = {"nft", "buildah", "docker", "podman", "mmdebstrap"}


def path_without(hidden: set[str], bin_dir: Path) -> str:
    """A PATH of one directory holding every program of this PATH but the hidden ones."""
    bin_dir.mkdir()
    for directory in os.environ.get("PATH", "").split(":"):
        for program in Path(directory).glob("*") if Path(directory).is_dir() else []:
            link = bin_dir / program.name
            if program.name not in hidden and not link.exists() and os.access(program, os.X_OK):
                link.symlink_to(program)
    return str(bin_dir)


@pytest.mark.slow
def test_without_a_builder_or_nft_the_run_stops_at_once_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": path_without(HIDDEN, tmp_path / "bin")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/images",
                           "tests/rehearsal/test_netns.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    said = [line for line in output.splitlines() if "need what this machine lacks" in line]
    assert len(said) == 1, output[-3000:]
    assert "an image builder (Docker, or buildah: apt-get install buildah)" in said[0], said[0]
    assert "nft (apt-get install nftables)" in said[0] and "`make test` installs it all" in said[0], said[0]
    assert not any(word in output for word in (" passed", " failed", " error")), output[-3000:]


def test_without_root_the_cluster_tests_stop_the_run_and_none_skips(monkeypatch: pytest.MonkeyPatch,
                                                                    pytestconfig: pytest.Config) -> None:
    """CI runs as root, so a test of tests/rehearsal that skipped without root (the relay's kill, pause
    and cut-off tests, the network-namespace tests did) would pass there quietly the day it lost root.
    Without root the run stops before any test, naming root; no module of tests/rehearsal skips on it."""
    from types import SimpleNamespace

    from tests import conftest

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    item = SimpleNamespace(path=REPO / "tests" / "rehearsal" / "test_relay_links.py", fixturenames=())
    with pytest.raises(pytest.exit.Exception, match="need what this machine lacks: root"):
        conftest._prepare_images(pytestconfig, [item])  # type: ignore[list-item]
    skipping = [path.name for path in (REPO / "tests" / "rehearsal").glob("test_*.py")
                if "geteuid" in path.read_text() or "pytest.skip" in path.read_text() or "skipif" in path.read_text()]
    assert not skipping, skipping
