from grpo.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FailurePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_POLICY_UNSPECIFIED: _ClassVar[FailurePolicy]
    FAILURE_POLICY_SKIP_GROUP: _ClassVar[FailurePolicy]
    FAILURE_POLICY_ASSIGN_VALUE: _ClassVar[FailurePolicy]

class Split(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPLIT_UNSPECIFIED: _ClassVar[Split]
    SPLIT_TRAIN: _ClassVar[Split]
    SPLIT_EVAL: _ClassVar[Split]
FAILURE_POLICY_UNSPECIFIED: FailurePolicy
FAILURE_POLICY_SKIP_GROUP: FailurePolicy
FAILURE_POLICY_ASSIGN_VALUE: FailurePolicy
SPLIT_UNSPECIFIED: Split
SPLIT_TRAIN: Split
SPLIT_EVAL: Split

class DescribeEnvironmentRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeEnvironmentResponse(_message.Message):
    __slots__ = ("name", "description", "options_json", "train_size", "eval_size", "failure_policy", "failure_reward", "score_timeout_seconds", "reward_min", "reward_max", "success_threshold", "max_turns", "tools_json", "respond_timeout_seconds", "episode_timeout_seconds", "max_episode_tokens", "levels")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_POLICY_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REWARD_FIELD_NUMBER: _ClassVar[int]
    SCORE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_MIN_FIELD_NUMBER: _ClassVar[int]
    REWARD_MAX_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    RESPOND_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEVELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    options_json: str
    train_size: int
    eval_size: int
    failure_policy: FailurePolicy
    failure_reward: float
    score_timeout_seconds: float
    reward_min: float
    reward_max: float
    success_threshold: float
    max_turns: int
    tools_json: str
    respond_timeout_seconds: float
    episode_timeout_seconds: float
    max_episode_tokens: int
    levels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., options_json: _Optional[str] = ..., train_size: _Optional[int] = ..., eval_size: _Optional[int] = ..., failure_policy: _Optional[_Union[FailurePolicy, str]] = ..., failure_reward: _Optional[float] = ..., score_timeout_seconds: _Optional[float] = ..., reward_min: _Optional[float] = ..., reward_max: _Optional[float] = ..., success_threshold: _Optional[float] = ..., max_turns: _Optional[int] = ..., tools_json: _Optional[str] = ..., respond_timeout_seconds: _Optional[float] = ..., episode_timeout_seconds: _Optional[float] = ..., max_episode_tokens: _Optional[int] = ..., levels: _Optional[_Iterable[str]] = ...) -> None: ...

class SamplePromptsRequest(_message.Message):
    __slots__ = ("n", "split", "start", "level")
    N_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    n: int
    split: Split
    start: int
    level: str
    def __init__(self, n: _Optional[int] = ..., split: _Optional[_Union[Split, str]] = ..., start: _Optional[int] = ..., level: _Optional[str] = ...) -> None: ...

class SamplePromptsResponse(_message.Message):
    __slots__ = ("prompts", "next_position")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_POSITION_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_types_pb2.Prompt]
    next_position: int
    def __init__(self, prompts: _Optional[_Iterable[_Union[_types_pb2.Prompt, _Mapping]]] = ..., next_position: _Optional[int] = ...) -> None: ...

class ScoreCompletionsRequest(_message.Message):
    __slots__ = ("prompt", "completions", "transcripts")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPTS_FIELD_NUMBER: _ClassVar[int]
    prompt: _types_pb2.Prompt
    completions: _containers.RepeatedCompositeFieldContainer[_types_pb2.Completion]
    transcripts: _containers.RepeatedCompositeFieldContainer[_types_pb2.Transcript]
    def __init__(self, prompt: _Optional[_Union[_types_pb2.Prompt, _Mapping]] = ..., completions: _Optional[_Iterable[_Union[_types_pb2.Completion, _Mapping]]] = ..., transcripts: _Optional[_Iterable[_Union[_types_pb2.Transcript, _Mapping]]] = ...) -> None: ...

class ScoreCompletionsResponse(_message.Message):
    __slots__ = ("rewards", "reward_infos", "skip_group", "failed_count")
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_INFOS_FIELD_NUMBER: _ClassVar[int]
    SKIP_GROUP_FIELD_NUMBER: _ClassVar[int]
    FAILED_COUNT_FIELD_NUMBER: _ClassVar[int]
    rewards: _containers.RepeatedScalarFieldContainer[float]
    reward_infos: _containers.RepeatedCompositeFieldContainer[_types_pb2.RewardInfo]
    skip_group: bool
    failed_count: int
    def __init__(self, rewards: _Optional[_Iterable[float]] = ..., reward_infos: _Optional[_Iterable[_Union[_types_pb2.RewardInfo, _Mapping]]] = ..., skip_group: _Optional[bool] = ..., failed_count: _Optional[int] = ...) -> None: ...

class ScoreCompletionsStreamRequest(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[ScoreCompletionsRequest]
    def __init__(self, groups: _Optional[_Iterable[_Union[ScoreCompletionsRequest, _Mapping]]] = ...) -> None: ...

class ScoreCompletionsStreamResponse(_message.Message):
    __slots__ = ("index", "result")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    index: int
    result: ScoreCompletionsResponse
    def __init__(self, index: _Optional[int] = ..., result: _Optional[_Union[ScoreCompletionsResponse, _Mapping]] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[ScoreCompletionsRequest]
    def __init__(self, groups: _Optional[_Iterable[_Union[ScoreCompletionsRequest, _Mapping]]] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("metrics", "results")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    results: _containers.RepeatedCompositeFieldContainer[ScoreCompletionsResponse]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., results: _Optional[_Iterable[_Union[ScoreCompletionsResponse, _Mapping]]] = ...) -> None: ...

class RespondRequest(_message.Message):
    __slots__ = ("prompt", "transcripts")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPTS_FIELD_NUMBER: _ClassVar[int]
    prompt: _types_pb2.Prompt
    transcripts: _containers.RepeatedCompositeFieldContainer[_types_pb2.Transcript]
    def __init__(self, prompt: _Optional[_Union[_types_pb2.Prompt, _Mapping]] = ..., transcripts: _Optional[_Iterable[_Union[_types_pb2.Transcript, _Mapping]]] = ...) -> None: ...

class RespondResponse(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[EnvReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[EnvReply, _Mapping]]] = ...) -> None: ...

class EnvReply(_message.Message):
    __slots__ = ("messages", "done", "reward", "failure", "tool_calls", "tool_errors")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    done: bool
    reward: float
    failure: str
    tool_calls: int
    tool_errors: int
    def __init__(self, messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., done: _Optional[bool] = ..., reward: _Optional[float] = ..., failure: _Optional[str] = ..., tool_calls: _Optional[int] = ..., tool_errors: _Optional[int] = ...) -> None: ...

class GetEnvironmentStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEnvironmentStateResponse(_message.Message):
    __slots__ = ("metrics", "train_position", "eval_position", "level_positions")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class LevelPositionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    TRAIN_POSITION_FIELD_NUMBER: _ClassVar[int]
    EVAL_POSITION_FIELD_NUMBER: _ClassVar[int]
    LEVEL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    train_position: int
    eval_position: int
    level_positions: _containers.ScalarMap[str, int]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ..., train_position: _Optional[int] = ..., eval_position: _Optional[int] = ..., level_positions: _Optional[_Mapping[str, int]] = ...) -> None: ...
