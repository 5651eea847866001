from grpo.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_KIND_UNSPECIFIED: _ClassVar[WorkerKind]
    WORKER_KIND_ROLLOUT: _ClassVar[WorkerKind]
    WORKER_KIND_LEARNER: _ClassVar[WorkerKind]
    WORKER_KIND_ENVIRONMENT: _ClassVar[WorkerKind]

class GroupVerdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_VERDICT_UNSPECIFIED: _ClassVar[GroupVerdict]
    GROUP_VERDICT_ACCEPTED: _ClassVar[GroupVerdict]
    GROUP_VERDICT_DUPLICATE: _ClassVar[GroupVerdict]
    GROUP_VERDICT_STALE: _ClassVar[GroupVerdict]
WORKER_KIND_UNSPECIFIED: WorkerKind
WORKER_KIND_ROLLOUT: WorkerKind
WORKER_KIND_LEARNER: WorkerKind
WORKER_KIND_ENVIRONMENT: WorkerKind
GROUP_VERDICT_UNSPECIFIED: GroupVerdict
GROUP_VERDICT_ACCEPTED: GroupVerdict
GROUP_VERDICT_DUPLICATE: GroupVerdict
GROUP_VERDICT_STALE: GroupVerdict

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("kind", "address")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    kind: WorkerKind
    address: str
    def __init__(self, kind: _Optional[_Union[WorkerKind, str]] = ..., address: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class SubmitGroupsRequest(_message.Message):
    __slots__ = ("groups", "source")
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[_types_pb2.ScoredGroup]
    source: str
    def __init__(self, groups: _Optional[_Iterable[_Union[_types_pb2.ScoredGroup, _Mapping]]] = ..., source: _Optional[str] = ...) -> None: ...

class SubmitGroupsResponse(_message.Message):
    __slots__ = ("verdicts", "reasons", "step", "learner_version", "waiting", "capacity")
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedScalarFieldContainer[GroupVerdict]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    step: int
    learner_version: int
    waiting: int
    capacity: int
    def __init__(self, verdicts: _Optional[_Iterable[_Union[GroupVerdict, str]]] = ..., reasons: _Optional[_Iterable[str]] = ..., step: _Optional[int] = ..., learner_version: _Optional[int] = ..., waiting: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RolloutLoad(_message.Message):
    __slots__ = ("rollout_id", "address", "weight_version", "in_flight", "max_in_flight", "healthy")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    address: str
    weight_version: int
    in_flight: int
    max_in_flight: int
    healthy: bool
    def __init__(self, rollout_id: _Optional[str] = ..., address: _Optional[str] = ..., weight_version: _Optional[int] = ..., in_flight: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., healthy: _Optional[bool] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("learner_version", "step", "paused", "groups_by_state", "queue_depths", "rollouts", "staleness_mean", "finished", "max_steps", "logprob_abs_diff_max", "error", "reward_mean", "loss", "steps_per_second", "tokens_per_second", "last_sync", "weight_transport", "uptime_seconds", "source", "queue_capacity", "group_size", "groups_per_batch", "level_success")
    class GroupsByStateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class QueueDepthsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LevelSuccessEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    GROUPS_BY_STATE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTHS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUTS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MEAN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_ABS_DIFF_MAX_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_PER_BATCH_FIELD_NUMBER: _ClassVar[int]
    LEVEL_SUCCESS_FIELD_NUMBER: _ClassVar[int]
    learner_version: int
    step: int
    paused: bool
    groups_by_state: _containers.ScalarMap[str, int]
    queue_depths: _containers.ScalarMap[str, int]
    rollouts: _containers.RepeatedCompositeFieldContainer[RolloutLoad]
    staleness_mean: float
    finished: bool
    max_steps: int
    logprob_abs_diff_max: float
    error: str
    reward_mean: float
    loss: float
    steps_per_second: float
    tokens_per_second: float
    last_sync: SyncPhases
    weight_transport: str
    uptime_seconds: float
    source: str
    queue_capacity: int
    group_size: int
    groups_per_batch: int
    level_success: _containers.ScalarMap[str, float]
    def __init__(self, learner_version: _Optional[int] = ..., step: _Optional[int] = ..., paused: _Optional[bool] = ..., groups_by_state: _Optional[_Mapping[str, int]] = ..., queue_depths: _Optional[_Mapping[str, int]] = ..., rollouts: _Optional[_Iterable[_Union[RolloutLoad, _Mapping]]] = ..., staleness_mean: _Optional[float] = ..., finished: _Optional[bool] = ..., max_steps: _Optional[int] = ..., logprob_abs_diff_max: _Optional[float] = ..., error: _Optional[str] = ..., reward_mean: _Optional[float] = ..., loss: _Optional[float] = ..., steps_per_second: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., last_sync: _Optional[_Union[SyncPhases, _Mapping]] = ..., weight_transport: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., source: _Optional[str] = ..., queue_capacity: _Optional[int] = ..., group_size: _Optional[int] = ..., groups_per_batch: _Optional[int] = ..., level_success: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SyncPhases(_message.Message):
    __slots__ = ("prepare_ms", "stage_ms", "commit_ms", "total_ms")
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    STAGE_MS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    prepare_ms: float
    stage_ms: float
    commit_ms: float
    total_ms: float
    def __init__(self, prepare_ms: _Optional[float] = ..., stage_ms: _Optional[float] = ..., commit_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("paused",)
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    paused: bool
    def __init__(self, paused: _Optional[bool] = ...) -> None: ...
