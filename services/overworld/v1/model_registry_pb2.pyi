from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VersionInfo(_message.Message):
    __slots__ = ("version", "parent", "sha256", "size_bytes", "dtype", "counters", "config_hash", "created_unix", "tags")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    version: int
    parent: int
    sha256: str
    size_bytes: int
    dtype: str
    counters: _containers.ScalarMap[str, int]
    config_hash: str
    created_unix: float
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., parent: _Optional[int] = ..., sha256: _Optional[str] = ..., size_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ..., config_hash: _Optional[str] = ..., created_unix: _Optional[float] = ..., tags: _Optional[_Iterable[str]] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("manifest", "chunk", "sha256")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    manifest: VersionInfo
    chunk: bytes
    sha256: str
    def __init__(self, manifest: _Optional[_Union[VersionInfo, _Mapping]] = ..., chunk: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("version", "tag", "offset", "chunk_size", "precision", "limit")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    version: int
    tag: str
    offset: int
    chunk_size: int
    precision: str
    limit: int
    def __init__(self, version: _Optional[int] = ..., tag: _Optional[str] = ..., offset: _Optional[int] = ..., chunk_size: _Optional[int] = ..., precision: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("info", "offset", "data")
    INFO_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    info: VersionInfo
    offset: int
    data: bytes
    def __init__(self, info: _Optional[_Union[VersionInfo, _Mapping]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("watcher_id", "known_version", "relay_port", "precision", "relay_host")
    WATCHER_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    RELAY_PORT_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    RELAY_HOST_FIELD_NUMBER: _ClassVar[int]
    watcher_id: str
    known_version: int
    relay_port: int
    precision: str
    relay_host: str
    def __init__(self, watcher_id: _Optional[str] = ..., known_version: _Optional[int] = ..., relay_port: _Optional[int] = ..., precision: _Optional[str] = ..., relay_host: _Optional[str] = ...) -> None: ...

class Announcement(_message.Message):
    __slots__ = ("info", "sources", "chunk_bytes", "weights_port", "chunk_hashes", "chunk_hash", "source_depths")
    INFO_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PORT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    info: VersionInfo
    sources: _containers.RepeatedScalarFieldContainer[str]
    chunk_bytes: int
    weights_port: int
    chunk_hashes: bytes
    chunk_hash: str
    source_depths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, info: _Optional[_Union[VersionInfo, _Mapping]] = ..., sources: _Optional[_Iterable[str]] = ..., chunk_bytes: _Optional[int] = ..., weights_port: _Optional[int] = ..., chunk_hashes: _Optional[bytes] = ..., chunk_hash: _Optional[str] = ..., source_depths: _Optional[_Iterable[int]] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionInfo]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionInfo, _Mapping]]] = ...) -> None: ...

class SetTagRequest(_message.Message):
    __slots__ = ("tag", "version", "remove")
    TAG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    tag: str
    version: int
    remove: bool
    def __init__(self, tag: _Optional[str] = ..., version: _Optional[int] = ..., remove: _Optional[bool] = ...) -> None: ...

class AckVersionRequest(_message.Message):
    __slots__ = ("watcher_id", "version", "relay_faults")
    WATCHER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RELAY_FAULTS_FIELD_NUMBER: _ClassVar[int]
    watcher_id: str
    version: int
    relay_faults: _containers.RepeatedCompositeFieldContainer[RelayFault]
    def __init__(self, watcher_id: _Optional[str] = ..., version: _Optional[int] = ..., relay_faults: _Optional[_Iterable[_Union[RelayFault, _Mapping]]] = ...) -> None: ...

class RelayFault(_message.Message):
    __slots__ = ("relay", "reason", "version")
    RELAY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    relay: str
    reason: str
    version: int
    def __init__(self, relay: _Optional[str] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class AckVersionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushStatusRequest(_message.Message):
    __slots__ = ("version", "wait_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    wait_seconds: float
    def __init__(self, version: _Optional[int] = ..., wait_seconds: _Optional[float] = ...) -> None: ...

class PushStatus(_message.Message):
    __slots__ = ("version", "watchers", "acked", "complete", "push_seconds", "workers_per_version", "connected_watchers", "published_unix", "last_ack_unix", "ack_seconds")
    class WorkersPerVersionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WATCHERS_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    PUSH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_WATCHERS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_FIELD_NUMBER: _ClassVar[int]
    LAST_ACK_UNIX_FIELD_NUMBER: _ClassVar[int]
    ACK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    watchers: int
    acked: int
    complete: bool
    push_seconds: float
    workers_per_version: _containers.ScalarMap[int, int]
    connected_watchers: int
    published_unix: float
    last_ack_unix: float
    ack_seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, version: _Optional[int] = ..., watchers: _Optional[int] = ..., acked: _Optional[int] = ..., complete: _Optional[bool] = ..., push_seconds: _Optional[float] = ..., workers_per_version: _Optional[_Mapping[int, int]] = ..., connected_watchers: _Optional[int] = ..., published_unix: _Optional[float] = ..., last_ack_unix: _Optional[float] = ..., ack_seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class PublishEndpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublishEndpoint(_message.Message):
    __slots__ = ("port", "chunk_bytes")
    PORT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    port: int
    chunk_bytes: int
    def __init__(self, port: _Optional[int] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...
