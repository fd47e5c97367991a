from overworld.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InsertRequest(_message.Message):
    __slots__ = ("fragment",)
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    fragment: _common_pb2.Fragment
    def __init__(self, fragment: _Optional[_Union[_common_pb2.Fragment, _Mapping]] = ...) -> None: ...

class InsertResponse(_message.Message):
    __slots__ = ("worker_id", "env_slot", "sequence", "stored")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_SLOT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    env_slot: int
    sequence: int
    stored: bool
    def __init__(self, worker_id: _Optional[str] = ..., env_slot: _Optional[int] = ..., sequence: _Optional[int] = ..., stored: _Optional[bool] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("num_chunks", "timeout_seconds", "reader_id", "allow_partial", "blob_refs")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READER_ID_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    BLOB_REFS_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    timeout_seconds: float
    reader_id: str
    allow_partial: bool
    blob_refs: bool
    def __init__(self, num_chunks: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., reader_id: _Optional[str] = ..., allow_partial: _Optional[bool] = ..., blob_refs: _Optional[bool] = ...) -> None: ...

class SampledChunk(_message.Message):
    __slots__ = ("chunk_id", "fragments", "times_sampled", "blob_keys")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    BLOB_KEYS_FIELD_NUMBER: _ClassVar[int]
    chunk_id: int
    fragments: _containers.RepeatedCompositeFieldContainer[_common_pb2.Fragment]
    times_sampled: int
    blob_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, chunk_id: _Optional[int] = ..., fragments: _Optional[_Iterable[_Union[_common_pb2.Fragment, _Mapping]]] = ..., times_sampled: _Optional[int] = ..., blob_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class SetModelVersionRequest(_message.Message):
    __slots__ = ("model_version",)
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    def __init__(self, model_version: _Optional[int] = ...) -> None: ...

class SetModelVersionResponse(_message.Message):
    __slots__ = ("dropped_chunks",)
    DROPPED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    dropped_chunks: int
    def __init__(self, dropped_chunks: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("worker_id", "fragments", "wait_seconds", "give_back", "starting")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GIVE_BACK_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    fragments: int
    wait_seconds: float
    give_back: int
    starting: int
    def __init__(self, worker_id: _Optional[str] = ..., fragments: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., give_back: _Optional[int] = ..., starting: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("granted", "limited", "ttl_seconds")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    LIMITED_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    granted: int
    limited: bool
    ttl_seconds: float
    def __init__(self, granted: _Optional[int] = ..., limited: _Optional[bool] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BufferStats(_message.Message):
    __slots__ = ("fragments", "chunks", "bytes", "inserted_fragments", "sampled_chunks", "dropped_chunks", "rejected_fragments", "model_version", "mean_reuse", "mean_staleness", "max_staleness", "capacity_chunks", "reserved_fragments", "expired_reservations")
    class DroppedChunksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RejectedFragmentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    INSERTED_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEAN_REUSE_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    fragments: int
    chunks: int
    bytes: int
    inserted_fragments: int
    sampled_chunks: int
    dropped_chunks: _containers.ScalarMap[str, int]
    rejected_fragments: _containers.ScalarMap[str, int]
    model_version: int
    mean_reuse: float
    mean_staleness: float
    max_staleness: int
    capacity_chunks: int
    reserved_fragments: int
    expired_reservations: int
    def __init__(self, fragments: _Optional[int] = ..., chunks: _Optional[int] = ..., bytes: _Optional[int] = ..., inserted_fragments: _Optional[int] = ..., sampled_chunks: _Optional[int] = ..., dropped_chunks: _Optional[_Mapping[str, int]] = ..., rejected_fragments: _Optional[_Mapping[str, int]] = ..., model_version: _Optional[int] = ..., mean_reuse: _Optional[float] = ..., mean_staleness: _Optional[float] = ..., max_staleness: _Optional[int] = ..., capacity_chunks: _Optional[int] = ..., reserved_fragments: _Optional[int] = ..., expired_reservations: _Optional[int] = ...) -> None: ...

class GetStoreInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreInfo(_message.Message):
    __slots__ = ("blob_store_url", "ref_grace_seconds")
    BLOB_STORE_URL_FIELD_NUMBER: _ClassVar[int]
    REF_GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    blob_store_url: str
    ref_grace_seconds: float
    def __init__(self, blob_store_url: _Optional[str] = ..., ref_grace_seconds: _Optional[float] = ...) -> None: ...
