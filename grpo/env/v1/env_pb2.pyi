from grpo.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Split(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPLIT_UNSPECIFIED: _ClassVar[Split]
    SPLIT_TRAIN: _ClassVar[Split]
    SPLIT_EVAL: _ClassVar[Split]
SPLIT_UNSPECIFIED: Split
SPLIT_TRAIN: Split
SPLIT_EVAL: Split

class DescribeEnvironmentRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeEnvironmentResponse(_message.Message):
    __slots__ = ("name", "description", "options_json", "train_size", "eval_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    options_json: str
    train_size: int
    eval_size: int
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., options_json: _Optional[str] = ..., train_size: _Optional[int] = ..., eval_size: _Optional[int] = ...) -> None: ...

class SamplePromptsRequest(_message.Message):
    __slots__ = ("n", "split")
    N_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    n: int
    split: Split
    def __init__(self, n: _Optional[int] = ..., split: _Optional[_Union[Split, str]] = ...) -> None: ...

class SamplePromptsResponse(_message.Message):
    __slots__ = ("prompts",)
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_types_pb2.Prompt]
    def __init__(self, prompts: _Optional[_Iterable[_Union[_types_pb2.Prompt, _Mapping]]] = ...) -> None: ...

class ScoreCompletionsRequest(_message.Message):
    __slots__ = ("prompt", "completions")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    prompt: _types_pb2.Prompt
    completions: _containers.RepeatedCompositeFieldContainer[_types_pb2.Completion]
    def __init__(self, prompt: _Optional[_Union[_types_pb2.Prompt, _Mapping]] = ..., completions: _Optional[_Iterable[_Union[_types_pb2.Completion, _Mapping]]] = ...) -> None: ...

class ScoreCompletionsResponse(_message.Message):
    __slots__ = ("rewards", "reward_infos")
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_INFOS_FIELD_NUMBER: _ClassVar[int]
    rewards: _containers.RepeatedScalarFieldContainer[float]
    reward_infos: _containers.RepeatedCompositeFieldContainer[_types_pb2.RewardInfo]
    def __init__(self, rewards: _Optional[_Iterable[float]] = ..., reward_infos: _Optional[_Iterable[_Union[_types_pb2.RewardInfo, _Mapping]]] = ...) -> None: ...
