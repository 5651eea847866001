from grpo.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RenderMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RENDER_MODE_UNSPECIFIED: _ClassVar[RenderMode]
    RENDER_MODE_CONVERSATION: _ClassVar[RenderMode]
    RENDER_MODE_BRIDGE: _ClassVar[RenderMode]
    RENDER_MODE_TEXT: _ClassVar[RenderMode]

class RolloutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLLOUT_STATUS_UNSPECIFIED: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_LOADING: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_READY: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_UPDATING: _ClassVar[RolloutStatus]
    ROLLOUT_STATUS_DRAINING: _ClassVar[RolloutStatus]
RENDER_MODE_UNSPECIFIED: RenderMode
RENDER_MODE_CONVERSATION: RenderMode
RENDER_MODE_BRIDGE: RenderMode
RENDER_MODE_TEXT: RenderMode
ROLLOUT_STATUS_UNSPECIFIED: RolloutStatus
ROLLOUT_STATUS_LOADING: RolloutStatus
ROLLOUT_STATUS_READY: RolloutStatus
ROLLOUT_STATUS_UPDATING: RolloutStatus
ROLLOUT_STATUS_DRAINING: RolloutStatus

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling_params", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _types_pb2.Prompt
    sampling_params: _types_pb2.SamplingParams
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Union[_types_pb2.Prompt, _Mapping]] = ..., sampling_params: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[_types_pb2.Completion]
    def __init__(self, completions: _Optional[_Iterable[_Union[_types_pb2.Completion, _Mapping]]] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[GenerateResult]
    def __init__(self, results: _Optional[_Iterable[_Union[GenerateResult, _Mapping]]] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("request_id", "completions", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    completions: _containers.RepeatedCompositeFieldContainer[_types_pb2.Completion]
    error: RequestError
    def __init__(self, request_id: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[_types_pb2.Completion, _Mapping]]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class StageWeightsRequest(_message.Message):
    __slots__ = ("weight_version", "rewind")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    weight_version: _types_pb2.WeightVersion
    rewind: bool
    def __init__(self, weight_version: _Optional[_Union[_types_pb2.WeightVersion, _Mapping]] = ..., rewind: _Optional[bool] = ...) -> None: ...

class StageWeightsResponse(_message.Message):
    __slots__ = ("version", "bytes", "fetch_ms", "received_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FETCH_MS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    bytes: int
    fetch_ms: float
    received_bytes: int
    def __init__(self, version: _Optional[int] = ..., bytes: _Optional[int] = ..., fetch_ms: _Optional[float] = ..., received_bytes: _Optional[int] = ...) -> None: ...

class CommitWeightsRequest(_message.Message):
    __slots__ = ("version", "rewind")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    version: int
    rewind: bool
    def __init__(self, version: _Optional[int] = ..., rewind: _Optional[bool] = ...) -> None: ...

class CommitWeightsResponse(_message.Message):
    __slots__ = ("version", "load_ms", "pause_ms")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_MS_FIELD_NUMBER: _ClassVar[int]
    version: int
    load_ms: float
    pause_ms: float
    def __init__(self, version: _Optional[int] = ..., load_ms: _Optional[float] = ..., pause_ms: _Optional[float] = ...) -> None: ...

class AbortWeightsRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class AbortWeightsResponse(_message.Message):
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

class RenderMessagesRequest(_message.Message):
    __slots__ = ("mode", "messages", "tools_json", "add_generation_prompt", "previous_tail", "text")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_TAIL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    mode: RenderMode
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    tools_json: str
    add_generation_prompt: bool
    previous_tail: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, mode: _Optional[_Union[RenderMode, str]] = ..., messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., previous_tail: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class RenderMessagesResponse(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class GetRolloutStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRolloutStateResponse(_message.Message):
    __slots__ = ("rollout_id", "weight_version", "staged_version", "status", "engine", "model", "in_flight", "max_in_flight", "tokens_generated", "weight_workers", "instance_id", "max_model_len")
    ROLLOUT_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    STAGED_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_WORKERS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    rollout_id: str
    weight_version: int
    staged_version: int
    status: RolloutStatus
    engine: str
    model: str
    in_flight: int
    max_in_flight: int
    tokens_generated: int
    weight_workers: int
    instance_id: str
    max_model_len: int
    def __init__(self, rollout_id: _Optional[str] = ..., weight_version: _Optional[int] = ..., staged_version: _Optional[int] = ..., status: _Optional[_Union[RolloutStatus, str]] = ..., engine: _Optional[str] = ..., model: _Optional[str] = ..., in_flight: _Optional[int] = ..., max_in_flight: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., weight_workers: _Optional[int] = ..., instance_id: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...
