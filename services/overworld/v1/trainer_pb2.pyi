from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StopRequest(_message.Message):
    __slots__ = ("seconds_left", "reason")
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    seconds_left: float
    reason: str
    def __init__(self, seconds_left: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class GetTrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("state", "iteration", "updates", "model_version", "samples_trained", "metrics", "error", "resumed_from", "start_model_version", "start_env_steps", "latest_checkpoint", "start_rho", "env_steps", "stop_requested", "stop_seconds_left")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TRAINED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_FIELD_NUMBER: _ClassVar[int]
    START_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    START_ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    LATEST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    START_RHO_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    STOP_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    STOP_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    state: str
    iteration: int
    updates: int
    model_version: int
    samples_trained: int
    metrics: _containers.ScalarMap[str, float]
    error: str
    resumed_from: str
    start_model_version: int
    start_env_steps: int
    latest_checkpoint: str
    start_rho: float
    env_steps: int
    stop_requested: bool
    stop_seconds_left: float
    def __init__(self, state: _Optional[str] = ..., iteration: _Optional[int] = ..., updates: _Optional[int] = ..., model_version: _Optional[int] = ..., samples_trained: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., error: _Optional[str] = ..., resumed_from: _Optional[str] = ..., start_model_version: _Optional[int] = ..., start_env_steps: _Optional[int] = ..., latest_checkpoint: _Optional[str] = ..., start_rho: _Optional[float] = ..., env_steps: _Optional[int] = ..., stop_requested: _Optional[bool] = ..., stop_seconds_left: _Optional[float] = ...) -> None: ...

class ReportProgressResponse(_message.Message):
    __slots__ = ("stop",)
    STOP_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    def __init__(self, stop: _Optional[bool] = ...) -> None: ...
