from grpo.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainStepRequest(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: _types_pb2.TrainBatch
    def __init__(self, batch: _Optional[_Union[_types_pb2.TrainBatch, _Mapping]] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("result", "completion_logprobs")
    RESULT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    result: _types_pb2.StepResult
    completion_logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.CompletionLogprobs]
    def __init__(self, result: _Optional[_Union[_types_pb2.StepResult, _Mapping]] = ..., completion_logprobs: _Optional[_Iterable[_Union[_types_pb2.CompletionLogprobs, _Mapping]]] = ...) -> None: ...

class PrepareWeightsRequest(_message.Message):
    __slots__ = ("transport", "receivers", "holders", "holders_listed")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RECEIVERS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_LISTED_FIELD_NUMBER: _ClassVar[int]
    transport: _types_pb2.WeightTransportKind
    receivers: _containers.RepeatedCompositeFieldContainer[WeightReceiver]
    holders: _containers.RepeatedCompositeFieldContainer[WeightHolder]
    holders_listed: bool
    def __init__(self, transport: _Optional[_Union[_types_pb2.WeightTransportKind, str]] = ..., receivers: _Optional[_Iterable[_Union[WeightReceiver, _Mapping]]] = ..., holders: _Optional[_Iterable[_Union[WeightHolder, _Mapping]]] = ..., holders_listed: _Optional[bool] = ...) -> None: ...

class WeightHolder(_message.Message):
    __slots__ = ("rollout_id", "instance_id", "version", "owns_weights")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNS_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    instance_id: str
    version: int
    owns_weights: bool
    def __init__(self, rollout_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., version: _Optional[int] = ..., owns_weights: _Optional[bool] = ...) -> None: ...

class WeightReceiver(_message.Message):
    __slots__ = ("rollout_id", "workers", "instance_id")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    workers: int
    instance_id: str
    def __init__(self, rollout_id: _Optional[str] = ..., workers: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class PrepareWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "prepare_ms")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PREPARE_MS_FIELD_NUMBER: _ClassVar[int]
    weight_version: _types_pb2.WeightVersion
    prepare_ms: float
    def __init__(self, weight_version: _Optional[_Union[_types_pb2.WeightVersion, _Mapping]] = ..., prepare_ms: _Optional[float] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("version", "buckets", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    buckets: _containers.RepeatedScalarFieldContainer[int]
    base_version: int
    def __init__(self, version: _Optional[int] = ..., buckets: _Optional[_Iterable[int]] = ..., base_version: _Optional[int] = ...) -> None: ...

class FetchWeightsResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: _types_pb2.WeightChunk
    def __init__(self, chunk: _Optional[_Union[_types_pb2.WeightChunk, _Mapping]] = ...) -> None: ...

class ReleaseWeightsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class ReleaseWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScoreTokensRequest(_message.Message):
    __slots__ = ("sequence",)
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    sequence: _types_pb2.TokenSequence
    def __init__(self, sequence: _Optional[_Union[_types_pb2.TokenSequence, _Mapping]] = ...) -> None: ...

class ScoreTokensResponse(_message.Message):
    __slots__ = ("logprobs", "weight_version")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_version: int
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class GetLearnerStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLearnerStateResponse(_message.Message):
    __slots__ = ("weight_version", "step", "model", "loss", "prepared_versions", "device", "dtype", "last_batch_id", "lineage_id", "instance_id", "ranks", "sharded")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PREPARED_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    LINEAGE_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    SHARDED_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    step: int
    model: str
    loss: str
    prepared_versions: _containers.RepeatedScalarFieldContainer[int]
    device: str
    dtype: str
    last_batch_id: str
    lineage_id: str
    instance_id: str
    ranks: int
    sharded: bool
    def __init__(self, weight_version: _Optional[int] = ..., step: _Optional[int] = ..., model: _Optional[str] = ..., loss: _Optional[str] = ..., prepared_versions: _Optional[_Iterable[int]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., last_batch_id: _Optional[str] = ..., lineage_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., ranks: _Optional[int] = ..., sharded: _Optional[bool] = ...) -> None: ...

class RestoreCheckpointRequest(_message.Message):
    __slots__ = ("lineage_id", "max_step", "min_step")
    LINEAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    lineage_id: str
    max_step: int
    min_step: int
    def __init__(self, lineage_id: _Optional[str] = ..., max_step: _Optional[int] = ..., min_step: _Optional[int] = ...) -> None: ...

class RestoreCheckpointResponse(_message.Message):
    __slots__ = ("step", "weight_version", "last_batch_id", "previous_step")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    last_batch_id: str
    previous_step: int
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., last_batch_id: _Optional[str] = ..., previous_step: _Optional[int] = ...) -> None: ...
