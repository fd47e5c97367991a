"""Blob stores for fragment payloads: a local directory (embedded) or S3 (cluster).

`get` of a missing key raises KeyError (LocalBlobStore: FileNotFoundError, a subclass of neither,
so callers catch both); `get_into(key, buf)` reads a blob into a reusable bytearray and returns a
view of it (same errors); `delete` of a missing key is not an error. `list_blobs` gives each key with
its last-modified time (seconds since the epoch), for the replay buffer's orphan sweeper.
`url` is what `open_blob_store` (urls.py) opens to reach the same blobs from another process (a local store's
absolute path, or `s3://BUCKET/PREFIX`; never credentials).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import urllib3

# What a blob store raises while it cannot be reached (a restarting object store, a name that does not
# resolve yet, a dropped connection): worth trying again, unlike a refusal (a missing bucket, a bad key).
UNREACHABLE = (OSError, urllib3.exceptions.HTTPError)


@dataclass(frozen=True)
class BlobInfo:
    key: str
    modified: float  # seconds since the epoch


class BlobStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def get_into(self, key: str, buf: bytearray) -> memoryview: ...
    def delete(self, keys: list[str]) -> None: ...
    def keys(self, prefix: str = "") -> list[str]: ...
    def list_blobs(self, prefix: str = "") -> list[BlobInfo]: ...


class LocalBlobStore:
    """One file per blob; written to a temporary name and renamed, so a reader never sees half a blob."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = str(self.root.resolve())

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid blob key {key!r}")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        self.put_parts(key, [data])

    def put_parts(self, key: str, parts: Iterable[bytes | bytearray | memoryview]) -> None:
        """The blob made of `parts` one after the other, written as they come (never assembled).
        Atomic: written aside, then renamed into place."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with tmp.open("wb", buffering=0) as f:
                for part in parts:
                    with memoryview(part) as view:
                        done = 0
                        while done < len(view):
                            done += f.write(view[done:])
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def get_into(self, key: str, buf: bytearray) -> memoryview:
        with self._path(key).open("rb", buffering=0) as f:
            return read_exactly(f.readinto, buf, os.fstat(f.fileno()).st_size, f"{key}: the file")

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def keys(self, prefix: str = "") -> list[str]:
        return [b.key for b in self.list_blobs(prefix)]

    def list_blobs(self, prefix: str = "") -> list[BlobInfo]:
        # Walk only the directory that holds the prefix, not the whole store.
        base = self.root
        start = base / prefix.rsplit("/", 1)[0] if "/" in prefix else base
        out = []
        for path in start.rglob("*") if start.is_dir() else ():
            if path.name.startswith("."):
                continue
            key = path.relative_to(base).as_posix()
            if key.startswith(prefix):
                try:
                    if path.is_file():
                        out.append(BlobInfo(key, path.stat().st_mtime))
                except FileNotFoundError:  # deleted while listing
                    continue
        return sorted(out, key=lambda b: b.key)


def reserve(buf: bytearray, size: int) -> None:
    """Grow buf to at least size bytes (it must have no views then)."""
    if len(buf) < size:
        buf.extend(bytes(size - len(buf)))


def read_exactly(readinto: Callable[[memoryview], int | None], buf: bytearray, size: int, what: str) -> memoryview:
    """`size` bytes from `readinto` into `buf` (grown when too small); a view of them."""
    reserve(buf, size)
    with memoryview(buf) as view:
        got = 0
        while got < size:
            n = readinto(view[got:size])
            if not n:
                raise OSError(f"{what} ended after {got} of {size} bytes")
            got += n
    return memoryview(buf)[:size]
