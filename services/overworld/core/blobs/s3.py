"""S3 blob store over the `minio` SDK (SeaweedFS in the cluster, any S3-protocol server elsewhere).

`s3://BUCKET/PREFIX`: every key is stored as `PREFIX/key` in BUCKET; the bucket is created when it
is missing. The endpoint and credentials come from OVERWORLD_S3_ENDPOINT (`http://host:port` or
`https://host:port`), OVERWORLD_S3_ACCESS_KEY and OVERWORLD_S3_SECRET_KEY, the names the chart sets.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlparse

import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import S3Error

from overworld.core.blobs.store import BlobInfo, read_exactly, reserve

MISSING_CODES = ("NoSuchKey", "NoSuchObject", "NoSuchVersion")


class S3BlobStore:
    def __init__(self, client: Minio, bucket: str, prefix: str = "", create_bucket: bool = True) -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        if create_bucket and not client.bucket_exists(bucket):
            try:
                client.make_bucket(bucket)
            except S3Error as err:  # another process created it meanwhile
                if err.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    @classmethod
    def from_url(cls, url: str, endpoint: str | None = None, access_key: str | None = None,
                 secret_key: str | None = None, pool_size: int = 32) -> S3BlobStore:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"expected s3://BUCKET/PREFIX, got {url!r}")
        endpoint = endpoint or os.environ.get("OVERWORLD_S3_ENDPOINT", "")
        if not endpoint:
            raise ValueError(f"{url}: set OVERWORLD_S3_ENDPOINT (http://host:port) for the S3 blob store")
        ep = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        # A pool larger than minio's default (10): fronts put and get many blobs in parallel.
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=10.0, read=120.0), maxsize=pool_size, block=False,
            retries=urllib3.Retry(total=5, backoff_factor=0.2, status_forcelist=[500, 502, 503, 504]))
        client = Minio(ep.netloc, access_key=access_key or os.environ.get("OVERWORLD_S3_ACCESS_KEY") or None,
                       secret_key=secret_key or os.environ.get("OVERWORLD_S3_SECRET_KEY") or None,
                       secure=ep.scheme == "https", http_client=http)
        return cls(client, parsed.netloc, parsed.path)

    def _name(self, key: str) -> str:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid blob key {key!r}")
        return f"{self.prefix}/{key}" if self.prefix else key

    def _key(self, name: str) -> str:
        return name[len(self.prefix) + 1:] if self.prefix else name

    def put(self, key: str, data: bytes | memoryview) -> None:
        if not isinstance(data, bytes):
            data = bytes(data)  # one copy: BytesIO over a memoryview copies more slowly than this
        self.client.put_object(self.bucket, self._name(key), io.BytesIO(data), len(data))

    def _open(self, key: str) -> Any:
        try:
            return self.client.get_object(self.bucket, self._name(key))
        except S3Error as err:
            if err.code in MISSING_CODES:
                raise KeyError(key) from None
            raise

    def get(self, key: str) -> bytes:
        response = self._open(key)
        try:
            data = response.read()
        except BaseException:
            response.close()  # a half-read connection cannot be reused
            raise
        # Fully read: back to the pool. (close() would drop the connection and cost a new one per get.)
        response.release_conn()
        return data

    def get_into(self, key: str, buf: bytearray) -> memoryview:
        """Like `get`, but the blob is read into `buf` (grown when too small) and a view of it is returned
        (release the view before passing `buf` again). A reader that fetches many large blobs reuses its
        buffers instead of allocating a fresh object per blob, whose page faults cost more than the copy."""
        response = self._open(key)
        try:
            size = int(response.headers.get("content-length") or -1)
            # urllib3's underlying http.client response reads straight into a buffer (urllib3's own
            # readinto reads into a new bytes object first); anything unusual takes the plain path.
            fp: Any = getattr(response, "_fp", None)  # a private attribute: no type to rely on
            if size < 0 or response.headers.get("content-encoding") or not hasattr(fp, "readinto"):
                data = response.read()
                size = len(data)
                reserve(buf, size)
                buf[:size] = data
            else:
                read_exactly(fp.readinto, buf, size, f"{key}: the connection")
        except BaseException:
            response.close()
            raise
        response.release_conn()
        return memoryview(buf)[:size]

    def delete(self, keys: Iterable[str]) -> None:
        objects = [DeleteObject(self._name(k)) for k in keys]
        for start in range(0, len(objects), 1000):  # S3 deletes at most 1000 keys per request
            errors = list(self.client.remove_objects(self.bucket, objects[start:start + 1000]))
            failed = [e for e in errors if e.code not in MISSING_CODES]
            if failed:
                raise OSError(f"S3 delete failed for {len(failed)} objects, first: {failed[0].name}: "
                              f"{failed[0].code} {failed[0].message}")

    def list_blobs(self, prefix: str = "") -> list[BlobInfo]:
        out = []
        for obj in self.client.list_objects(self.bucket, prefix=self._name(prefix) if prefix else
                                            (f"{self.prefix}/" if self.prefix else None), recursive=True):
            if obj.is_dir or obj.object_name is None:
                continue
            modified = obj.last_modified.timestamp() if obj.last_modified else 0.0
            out.append(BlobInfo(self._key(obj.object_name), modified))
        return sorted(out, key=lambda b: b.key)

    def keys(self, prefix: str = "") -> list[str]:
        return [b.key for b in self.list_blobs(prefix)]
