from overworld.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetRunConfigRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunConfig(_message.Message):
    __slots__ = ("run_id", "config_yaml", "config_hash")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    config_yaml: str
    config_hash: str
    def __init__(self, run_id: _Optional[str] = ..., config_yaml: _Optional[str] = ..., config_hash: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("hostname", "num_envs", "spaces", "address")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    SPACES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    num_envs: int
    spaces: _common_pb2.Spaces
    address: str
    def __init__(self, hostname: _Optional[str] = ..., num_envs: _Optional[int] = ..., spaces: _Optional[_Union[_common_pb2.Spaces, _Mapping]] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "lease_seconds", "run_id", "worker_index")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_seconds: float
    run_id: str
    worker_index: int
    def __init__(self, worker_id: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., run_id: _Optional[str] = ..., worker_index: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "env_steps", "fragments_sent", "model_version", "env_steps_per_second", "env_restarts", "fragments_dropped", "send_queue_depth", "fragments_completed", "envs_ready", "room_wait_seconds", "env_slot_seconds", "preempted_env_steps")
    class EnvRestartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_SENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ENV_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    SEND_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ENVS_READY_FIELD_NUMBER: _ClassVar[int]
    ROOM_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENV_SLOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    env_steps: int
    fragments_sent: int
    model_version: int
    env_steps_per_second: float
    env_restarts: _containers.ScalarMap[str, int]
    fragments_dropped: int
    send_queue_depth: int
    fragments_completed: int
    envs_ready: int
    room_wait_seconds: float
    env_slot_seconds: float
    preempted_env_steps: int
    def __init__(self, worker_id: _Optional[str] = ..., env_steps: _Optional[int] = ..., fragments_sent: _Optional[int] = ..., model_version: _Optional[int] = ..., env_steps_per_second: _Optional[float] = ..., env_restarts: _Optional[_Mapping[str, int]] = ..., fragments_dropped: _Optional[int] = ..., send_queue_depth: _Optional[int] = ..., fragments_completed: _Optional[int] = ..., envs_ready: _Optional[int] = ..., room_wait_seconds: _Optional[float] = ..., env_slot_seconds: _Optional[float] = ..., preempted_env_steps: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_valid", "record_video", "video_request_id")
    LEASE_VALID_FIELD_NUMBER: _ClassVar[int]
    RECORD_VIDEO_FIELD_NUMBER: _ClassVar[int]
    VIDEO_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    lease_valid: bool
    record_video: bool
    video_request_id: str
    def __init__(self, lease_valid: _Optional[bool] = ..., record_video: _Optional[bool] = ..., video_request_id: _Optional[str] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EpisodeStats(_message.Message):
    __slots__ = ("task", "sum_reward", "discounted_reward", "length", "model_version", "extras")
    class ExtrasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_FIELD_NUMBER: _ClassVar[int]
    SUM_REWARD_FIELD_NUMBER: _ClassVar[int]
    DISCOUNTED_REWARD_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXTRAS_FIELD_NUMBER: _ClassVar[int]
    task: str
    sum_reward: float
    discounted_reward: float
    length: int
    model_version: int
    extras: _containers.ScalarMap[str, float]
    def __init__(self, task: _Optional[str] = ..., sum_reward: _Optional[float] = ..., discounted_reward: _Optional[float] = ..., length: _Optional[int] = ..., model_version: _Optional[int] = ..., extras: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReportEpisodesRequest(_message.Message):
    __slots__ = ("worker_id", "episodes", "report_sequence")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    REPORT_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    episodes: _containers.RepeatedCompositeFieldContainer[EpisodeStats]
    report_sequence: int
    def __init__(self, worker_id: _Optional[str] = ..., episodes: _Optional[_Iterable[_Union[EpisodeStats, _Mapping]]] = ..., report_sequence: _Optional[int] = ...) -> None: ...

class ReportEpisodesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSpacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetFleetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "hostname", "address", "num_envs", "env_steps", "fragments_sent", "model_version", "seconds_since_heartbeat", "env_steps_per_second", "env_restarts", "fragments_dropped", "send_queue_depth", "fragments_completed", "envs_ready", "room_wait_seconds", "env_slot_seconds")
    class EnvRestartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_ENVS_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_SENT_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ENV_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    SEND_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    ENVS_READY_FIELD_NUMBER: _ClassVar[int]
    ROOM_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENV_SLOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    hostname: str
    address: str
    num_envs: int
    env_steps: int
    fragments_sent: int
    model_version: int
    seconds_since_heartbeat: float
    env_steps_per_second: float
    env_restarts: _containers.ScalarMap[str, int]
    fragments_dropped: int
    send_queue_depth: int
    fragments_completed: int
    envs_ready: int
    room_wait_seconds: float
    env_slot_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., hostname: _Optional[str] = ..., address: _Optional[str] = ..., num_envs: _Optional[int] = ..., env_steps: _Optional[int] = ..., fragments_sent: _Optional[int] = ..., model_version: _Optional[int] = ..., seconds_since_heartbeat: _Optional[float] = ..., env_steps_per_second: _Optional[float] = ..., env_restarts: _Optional[_Mapping[str, int]] = ..., fragments_dropped: _Optional[int] = ..., send_queue_depth: _Optional[int] = ..., fragments_completed: _Optional[int] = ..., envs_ready: _Optional[int] = ..., room_wait_seconds: _Optional[float] = ..., env_slot_seconds: _Optional[float] = ...) -> None: ...

class ListLeasesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Leases(_message.Message):
    __slots__ = ("worker_ids", "lease_seconds")
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_seconds: float
    def __init__(self, worker_ids: _Optional[_Iterable[str]] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class TaskStats(_message.Message):
    __slots__ = ("task", "episodes", "mean_return_last_100", "mean_length_last_100", "mean_discounted_return_last_100", "mean_extras_last_100", "total_return", "total_discounted_return", "total_length", "total_extras")
    class MeanExtrasLast100Entry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class TotalExtrasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TASK_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    MEAN_RETURN_LAST_100_FIELD_NUMBER: _ClassVar[int]
    MEAN_LENGTH_LAST_100_FIELD_NUMBER: _ClassVar[int]
    MEAN_DISCOUNTED_RETURN_LAST_100_FIELD_NUMBER: _ClassVar[int]
    MEAN_EXTRAS_LAST_100_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RETURN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_DISCOUNTED_RETURN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOTAL_EXTRAS_FIELD_NUMBER: _ClassVar[int]
    task: str
    episodes: int
    mean_return_last_100: float
    mean_length_last_100: float
    mean_discounted_return_last_100: float
    mean_extras_last_100: _containers.ScalarMap[str, float]
    total_return: float
    total_discounted_return: float
    total_length: int
    total_extras: _containers.ScalarMap[str, float]
    def __init__(self, task: _Optional[str] = ..., episodes: _Optional[int] = ..., mean_return_last_100: _Optional[float] = ..., mean_length_last_100: _Optional[float] = ..., mean_discounted_return_last_100: _Optional[float] = ..., mean_extras_last_100: _Optional[_Mapping[str, float]] = ..., total_return: _Optional[float] = ..., total_discounted_return: _Optional[float] = ..., total_length: _Optional[int] = ..., total_extras: _Optional[_Mapping[str, float]] = ...) -> None: ...

class FleetStatus(_message.Message):
    __slots__ = ("run_id", "workers", "env_steps", "episodes", "mean_return_last_100", "tasks", "videos", "pending_video_requests", "fragments_sent", "fragments_lost", "fleet_id", "room_wait_seconds", "env_slot_seconds", "preempted_env_steps")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    MEAN_RETURN_LAST_100_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    PENDING_VIDEO_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_SENT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_LOST_FIELD_NUMBER: _ClassVar[int]
    FLEET_ID_FIELD_NUMBER: _ClassVar[int]
    ROOM_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENV_SLOT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_ENV_STEPS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    env_steps: int
    episodes: int
    mean_return_last_100: float
    tasks: _containers.RepeatedCompositeFieldContainer[TaskStats]
    videos: int
    pending_video_requests: int
    fragments_sent: int
    fragments_lost: int
    fleet_id: str
    room_wait_seconds: float
    env_slot_seconds: float
    preempted_env_steps: int
    def __init__(self, run_id: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., env_steps: _Optional[int] = ..., episodes: _Optional[int] = ..., mean_return_last_100: _Optional[float] = ..., tasks: _Optional[_Iterable[_Union[TaskStats, _Mapping]]] = ..., videos: _Optional[int] = ..., pending_video_requests: _Optional[int] = ..., fragments_sent: _Optional[int] = ..., fragments_lost: _Optional[int] = ..., fleet_id: _Optional[str] = ..., room_wait_seconds: _Optional[float] = ..., env_slot_seconds: _Optional[float] = ..., preempted_env_steps: _Optional[int] = ...) -> None: ...

class RequestVideoRequest(_message.Message):
    __slots__ = ("iteration",)
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    def __init__(self, iteration: _Optional[int] = ...) -> None: ...

class RequestVideoResponse(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class VideoInfo(_message.Message):
    __slots__ = ("request_id", "key", "worker_id", "env_slot", "task", "sum_reward", "length", "model_version", "iteration", "created_unix", "size_bytes", "fps")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_SLOT_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SUM_REWARD_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    key: str
    worker_id: str
    env_slot: int
    task: str
    sum_reward: float
    length: int
    model_version: int
    iteration: int
    created_unix: float
    size_bytes: int
    fps: int
    def __init__(self, request_id: _Optional[str] = ..., key: _Optional[str] = ..., worker_id: _Optional[str] = ..., env_slot: _Optional[int] = ..., task: _Optional[str] = ..., sum_reward: _Optional[float] = ..., length: _Optional[int] = ..., model_version: _Optional[int] = ..., iteration: _Optional[int] = ..., created_unix: _Optional[float] = ..., size_bytes: _Optional[int] = ..., fps: _Optional[int] = ...) -> None: ...

class VideoChunk(_message.Message):
    __slots__ = ("info", "data")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    info: VideoInfo
    data: bytes
    def __init__(self, info: _Optional[_Union[VideoInfo, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ListVideosRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVideosResponse(_message.Message):
    __slots__ = ("videos",)
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    videos: _containers.RepeatedCompositeFieldContainer[VideoInfo]
    def __init__(self, videos: _Optional[_Iterable[_Union[VideoInfo, _Mapping]]] = ...) -> None: ...
