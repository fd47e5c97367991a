from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_ZLIB: _ClassVar[Compression]
COMPRESSION_NONE: Compression
COMPRESSION_ZLIB: Compression

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class Spaces(_message.Message):
    __slots__ = ("obs", "action", "state")
    OBS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    obs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    action: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    state: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, obs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., action: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., state: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class FragmentHeader(_message.Message):
    __slots__ = ("run_id", "worker_id", "env_slot", "sequence", "length", "first_model_version", "compression")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_SLOT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    FIRST_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker_id: str
    env_slot: int
    sequence: int
    length: int
    first_model_version: int
    compression: Compression
    def __init__(self, run_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., env_slot: _Optional[int] = ..., sequence: _Optional[int] = ..., length: _Optional[int] = ..., first_model_version: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ...) -> None: ...

class Fragment(_message.Message):
    __slots__ = ("header", "tensors")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    header: FragmentHeader
    tensors: bytes
    def __init__(self, header: _Optional[_Union[FragmentHeader, _Mapping]] = ..., tensors: _Optional[bytes] = ...) -> None: ...
