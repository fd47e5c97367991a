from __future__ import annotations

import hashlib
from collections.abc import Iterator

from overworld.core.grpc_util import channel, retry
from overworld.v1 import model_registry_pb2 as pb
from overworld.v1 import model_registry_pb2_grpc

CHUNK = 1 << 20


class ModelRegistryClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = channel(address)
        self.stub = model_registry_pb2_grpc.ModelRegistryStub(self._channel)

    def publish(self, version: int, data: bytes, parent: int = 0, counters: dict[str, int] | None = None,
                config_hash: str = "", tags: list[str] | None = None, dtype: str = "float32",
                timeout: float = 300.0) -> pb.VersionInfo:
        manifest = pb.VersionInfo(version=version, parent=parent, sha256=hashlib.sha256(data).hexdigest(),
                                  size_bytes=len(data), dtype=dtype, counters=counters or {},
                                  config_hash=config_hash, tags=tags or [])

        def messages() -> Iterator[pb.PublishRequest]:
            yield pb.PublishRequest(manifest=manifest)
            for i in range(0, len(data), CHUNK):
                yield pb.PublishRequest(chunk=data[i:i + CHUNK])

        return retry(lambda: self.stub.Publish(messages(), timeout=timeout), "registry.Publish", timeout)

    def fetch(self, version: int = 0, tag: str = "", timeout: float = 300.0) -> tuple[pb.VersionInfo, bytes]:
        """Fetch a whole version, resuming from the last byte received if the stream breaks."""
        parts: list[bytes] = []
        info: pb.VersionInfo | None = None
        received = 0

        def attempt() -> None:
            nonlocal info, received
            for chunk in self.stub.Fetch(pb.FetchRequest(version=version or (info.version if info else 0),
                                                         tag=tag, offset=received), timeout=timeout):
                if chunk.HasField("info") and info is None:
                    info = chunk.info
                if chunk.offset != received:
                    raise ValueError(f"registry sent offset {chunk.offset}, expected {received}")
                parts.append(chunk.data)
                received += len(chunk.data)

        retry(attempt, "registry.Fetch", timeout)
        assert info is not None
        data = b"".join(parts)
        if hashlib.sha256(data).hexdigest() != info.sha256:
            raise ValueError(f"fetched version {info.version} does not match its sha256")
        return info, data

    def close(self) -> None:
        self._channel.close()
