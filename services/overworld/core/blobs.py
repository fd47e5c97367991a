"""Blob stores for fragment payloads: a local directory (embedded) or S3 (cluster)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Protocol


class BlobStore(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def delete(self, keys: list[str]) -> None: ...
    def keys(self, prefix: str = "") -> list[str]: ...


class LocalBlobStore:
    """One file per blob; written to a temporary name and renamed, so a reader never sees half a blob."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid blob key {key!r}")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def keys(self, prefix: str = "") -> list[str]:
        base = self.root
        out = []
        for path in base.rglob("*"):
            if path.is_file() and not path.name.startswith("."):
                key = path.relative_to(base).as_posix()
                if key.startswith(prefix):
                    out.append(key)
        return sorted(out)


def open_blob_store(url: str) -> BlobStore:
    if url.startswith("s3://"):
        from overworld.core.s3_blobs import S3BlobStore

        return S3BlobStore.from_url(url)
    return LocalBlobStore(url)
