from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetWorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "num_envs", "env_steps", "fragments_sent", "fragments_dropped", "model_version", "send_queue_depth", "env_steps_per_second", "env_restarts")
    class EnvRestartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_SENT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SEND_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ENV_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_envs: int
    env_steps: int
    fragments_sent: int
    fragments_dropped: int
    model_version: int
    send_queue_depth: int
    env_steps_per_second: float
    env_restarts: _containers.ScalarMap[str, int]
    def __init__(self, worker_id: _Optional[str] = ..., num_envs: _Optional[int] = ..., env_steps: _Optional[int] = ..., fragments_sent: _Optional[int] = ..., fragments_dropped: _Optional[int] = ..., model_version: _Optional[int] = ..., send_queue_depth: _Optional[int] = ..., env_steps_per_second: _Optional[float] = ..., env_restarts: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
