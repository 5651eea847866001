from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class TurnSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_SOURCE_UNSPECIFIED: _ClassVar[TurnSource]
    TURN_SOURCE_MODEL: _ClassVar[TurnSource]
    TURN_SOURCE_ENV: _ClassVar[TurnSource]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_XXH3_64: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_ALGORITHM_WSUM64: _ClassVar[ChecksumAlgorithm]

class WeightTransportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_KIND_UNSPECIFIED: _ClassVar[WeightTransportKind]
    WEIGHT_TRANSPORT_KIND_GRPC_STREAM: _ClassVar[WeightTransportKind]
    WEIGHT_TRANSPORT_KIND_SHARED_MEMORY: _ClassVar[WeightTransportKind]
    WEIGHT_TRANSPORT_KIND_CUDA_IPC: _ClassVar[WeightTransportKind]
    WEIGHT_TRANSPORT_KIND_NCCL: _ClassVar[WeightTransportKind]
    WEIGHT_TRANSPORT_KIND_CHECKPOINT: _ClassVar[WeightTransportKind]

class BucketEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUCKET_ENCODING_UNSPECIFIED: _ClassVar[BucketEncoding]
    BUCKET_ENCODING_DELTA_INDICES: _ClassVar[BucketEncoding]
    BUCKET_ENCODING_DELTA_BITMAP: _ClassVar[BucketEncoding]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
TURN_SOURCE_UNSPECIFIED: TurnSource
TURN_SOURCE_MODEL: TurnSource
TURN_SOURCE_ENV: TurnSource
CHECKSUM_ALGORITHM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_ALGORITHM_XXH3_64: ChecksumAlgorithm
CHECKSUM_ALGORITHM_WSUM64: ChecksumAlgorithm
WEIGHT_TRANSPORT_KIND_UNSPECIFIED: WeightTransportKind
WEIGHT_TRANSPORT_KIND_GRPC_STREAM: WeightTransportKind
WEIGHT_TRANSPORT_KIND_SHARED_MEMORY: WeightTransportKind
WEIGHT_TRANSPORT_KIND_CUDA_IPC: WeightTransportKind
WEIGHT_TRANSPORT_KIND_NCCL: WeightTransportKind
WEIGHT_TRANSPORT_KIND_CHECKPOINT: WeightTransportKind
BUCKET_ENCODING_UNSPECIFIED: BucketEncoding
BUCKET_ENCODING_DELTA_INDICES: BucketEncoding
BUCKET_ENCODING_DELTA_BITMAP: BucketEncoding

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ...) -> None: ...

class Transcript(_message.Message):
    __slots__ = ("messages", "failure")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    failure: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., failure: _Optional[str] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("id", "env_name", "text", "messages", "reference_answer", "metadata", "tools_json")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    ENV_NAME_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    id: str
    env_name: str
    text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    reference_answer: str
    metadata: _containers.ScalarMap[str, str]
    tools_json: str
    def __init__(self, id: _Optional[str] = ..., env_name: _Optional[str] = ..., text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., reference_answer: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightVersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("source", "start", "end", "finish_reason", "reward")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    source: TurnSource
    start: int
    end: int
    finish_reason: FinishReason
    reward: float
    def __init__(self, source: _Optional[_Union[TurnSource, str]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., reward: _Optional[float] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("prompt_id", "index", "prompt_token_ids", "completion_token_ids", "logprobs", "finish_reason", "version_spans", "sampling_params", "text", "rollout_id", "turns")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    version_spans: _containers.RepeatedCompositeFieldContainer[WeightVersionSpan]
    sampling_params: SamplingParams
    text: str
    rollout_id: str
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    def __init__(self, prompt_id: _Optional[str] = ..., index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., version_spans: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., text: _Optional[str] = ..., rollout_id: _Optional[str] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ...) -> None: ...

class RewardInfo(_message.Message):
    __slots__ = ("ok", "failure", "parsed_answer", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    PARSED_ANSWER_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    failure: str
    parsed_answer: str
    details: _containers.ScalarMap[str, str]
    def __init__(self, ok: _Optional[bool] = ..., failure: _Optional[str] = ..., parsed_answer: _Optional[str] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoredGroup(_message.Message):
    __slots__ = ("group_id", "prompt", "completions", "rewards", "advantages", "reward_infos", "prompt_token_ids", "sampling_params", "rollout_id")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    REWARD_INFOS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt: Prompt
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    rewards: _containers.RepeatedScalarFieldContainer[float]
    advantages: _containers.RepeatedScalarFieldContainer[float]
    reward_infos: _containers.RepeatedCompositeFieldContainer[RewardInfo]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    rollout_id: str
    def __init__(self, group_id: _Optional[str] = ..., prompt: _Optional[_Union[Prompt, _Mapping]] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., rewards: _Optional[_Iterable[float]] = ..., advantages: _Optional[_Iterable[float]] = ..., reward_infos: _Optional[_Iterable[_Union[RewardInfo, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., rollout_id: _Optional[str] = ...) -> None: ...

class TrainBatch(_message.Message):
    __slots__ = ("batch_id", "step", "groups")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    step: int
    groups: _containers.RepeatedCompositeFieldContainer[ScoredGroup]
    def __init__(self, batch_id: _Optional[str] = ..., step: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[ScoredGroup, _Mapping]]] = ...) -> None: ...

class CompletionLogprobs(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GroupLogprobs(_message.Message):
    __slots__ = ("group_id", "step", "completions")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    step: int
    completions: _containers.RepeatedCompositeFieldContainer[CompletionLogprobs]
    def __init__(self, group_id: _Optional[str] = ..., step: _Optional[int] = ..., completions: _Optional[_Iterable[_Union[CompletionLogprobs, _Mapping]]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step", "weight_version", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    weight_version: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, step: _Optional[int] = ..., weight_version: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids", "temperature")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("index", "offset", "nbytes", "digest")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    nbytes: int
    digest: str
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class GrpcStreamTransport(_message.Message):
    __slots__ = ("address", "chunk_bytes")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    address: str
    chunk_bytes: int
    def __init__(self, address: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class SharedMemoryTransport(_message.Message):
    __slots__ = ("segment_name", "size")
    SEGMENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    segment_name: str
    size: int
    def __init__(self, segment_name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class CudaIpcBucket(_message.Message):
    __slots__ = ("device_uuid", "handle", "storage_offset", "nbytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "storage_size_bytes", "event_sync_required", "slot")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    handle: bytes
    storage_offset: int
    nbytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    storage_size_bytes: int
    event_sync_required: bool
    slot: int
    def __init__(self, device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., storage_offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., event_sync_required: _Optional[bool] = ..., slot: _Optional[int] = ...) -> None: ...

class CudaIpcTransport(_message.Message):
    __slots__ = ("buckets",)
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[CudaIpcBucket]
    def __init__(self, buckets: _Optional[_Iterable[_Union[CudaIpcBucket, _Mapping]]] = ...) -> None: ...

class NcclTransport(_message.Message):
    __slots__ = ("master_address", "master_port", "world_size", "ranks", "group_id", "deadline_seconds", "backend", "broadcast_id", "secret", "transfer_floor_s", "transfer_min_rate_mb_s", "bucket_deltas")
    class RanksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_ID_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FLOOR_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MIN_RATE_MB_S_FIELD_NUMBER: _ClassVar[int]
    BUCKET_DELTAS_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    world_size: int
    ranks: _containers.ScalarMap[str, int]
    group_id: str
    deadline_seconds: float
    backend: str
    broadcast_id: str
    secret: str
    transfer_floor_s: float
    transfer_min_rate_mb_s: float
    bucket_deltas: _containers.RepeatedCompositeFieldContainer[NcclBucketDelta]
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Mapping[str, int]] = ..., group_id: _Optional[str] = ..., deadline_seconds: _Optional[float] = ..., backend: _Optional[str] = ..., broadcast_id: _Optional[str] = ..., secret: _Optional[str] = ..., transfer_floor_s: _Optional[float] = ..., transfer_min_rate_mb_s: _Optional[float] = ..., bucket_deltas: _Optional[_Iterable[_Union[NcclBucketDelta, _Mapping]]] = ...) -> None: ...

class NcclBucketDelta(_message.Message):
    __slots__ = ("encoding", "payload_bytes")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    encoding: BucketEncoding
    payload_bytes: int
    def __init__(self, encoding: _Optional[_Union[BucketEncoding, str]] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class CheckpointTransport(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("rank", "alpha", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class WeightVersion(_message.Message):
    __slots__ = ("version", "parent_version", "tensors", "buckets", "total_bytes", "checksum_algorithm", "delta_base_version", "delta_base_digest", "adapter", "grpc_stream", "shared_memory", "cuda_ipc", "nccl", "checkpoint")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    GRPC_STREAM_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    NCCL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    version: int
    parent_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    buckets: _containers.RepeatedCompositeFieldContainer[WeightBucket]
    total_bytes: int
    checksum_algorithm: ChecksumAlgorithm
    delta_base_version: int
    delta_base_digest: str
    adapter: LoraAdapter
    grpc_stream: GrpcStreamTransport
    shared_memory: SharedMemoryTransport
    cuda_ipc: CudaIpcTransport
    nccl: NcclTransport
    checkpoint: CheckpointTransport
    def __init__(self, version: _Optional[int] = ..., parent_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., buckets: _Optional[_Iterable[_Union[WeightBucket, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., checksum_algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., delta_base_version: _Optional[int] = ..., delta_base_digest: _Optional[str] = ..., adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ..., grpc_stream: _Optional[_Union[GrpcStreamTransport, _Mapping]] = ..., shared_memory: _Optional[_Union[SharedMemoryTransport, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcTransport, _Mapping]] = ..., nccl: _Optional[_Union[NcclTransport, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointTransport, _Mapping]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("version", "bucket", "offset", "data", "encoding", "payload_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    bucket: int
    offset: int
    data: bytes
    encoding: BucketEncoding
    payload_bytes: int
    def __init__(self, version: _Optional[int] = ..., bucket: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., encoding: _Optional[_Union[BucketEncoding, str]] = ..., payload_bytes: _Optional[int] = ...) -> None: ...
