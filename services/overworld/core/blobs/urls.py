"""The blob store a URL names: `s3://BUCKET/PREFIX` (s3.py) or a local directory (store.py).
Apart from both stores so that neither imports the other."""

from __future__ import annotations

from overworld.core.blobs.store import BlobStore, LocalBlobStore


def open_blob_store(url: str) -> BlobStore:
    if url.startswith("s3://"):
        from overworld.core.blobs.s3 import S3BlobStore  # minio only where a run uses S3

        return S3BlobStore.from_url(url)
    return LocalBlobStore(url)
