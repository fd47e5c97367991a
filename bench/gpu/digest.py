"""Which code a GPU call ran: the box has the checkout's files but not its git history, so the probe
records a digest of the sources, and the collector here compares it with the commit's.
Standard library only (it runs on the box before anything is installed)."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from collections.abc import Iterable
from pathlib import Path

SOURCES = ("services", "bench", "examples")
SUFFIXES = (".py", ".yaml", ".txt", ".sh", ".proto")
LEFT_OUT = ("bench/results/",)  # what the collector writes after the call


def counted(path: str) -> bool:
    return path.endswith(SUFFIXES) and "__pycache__" not in path and not path.startswith(LEFT_OUT)


def digest_of(files: Iterable[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for path, data in sorted(files):
        h.update(path.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def code_digest(root: Path) -> str:
    """The digest of the source files under SOURCES as they are in `root`."""
    files = []
    for top in SOURCES:
        for path in (root / top).rglob("*"):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and counted(rel):
                files.append((rel, path.read_bytes()))
    return digest_of(files)


def commit_digest(root: Path, commit: str = "HEAD") -> str:
    """The same digest of `commit`'s tree."""
    archive = subprocess.run(["git", "archive", "--format=tar", commit, *SOURCES], cwd=root, capture_output=True,
                             check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        files = [(m.name, tar.extractfile(m).read())  # type: ignore[union-attr]
                 for m in tar.getmembers() if m.isfile() and counted(m.name)]
    return digest_of(files)
