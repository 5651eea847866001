"""What the scheduler needs from its three peers, in domain terms: `EnvClient`, `LearnerClient`,
`RolloutClient` (the seam vLLM's entrypoints have in `EngineClient`).

The orchestrator, the weight syncer, the evaluator and the rollout pool depend only on these
protocols. `grpc_clients.py` implements them over gRPC and owns everything RPC: request and response
envelopes, channels, deadlines, and turning status codes into domain errors
(`services.common.errors`: a failure's `retryable` / `unreachable` flags are all callers look at).
Tests implement them in memory (tests/scheduler/fakes.py), so orchestration is tested in milliseconds.

The payloads are the shared data messages of `grpo.common.v1` (Prompt, Completion, RewardInfo,
TokenSequence, WeightVersion): they are the system's data model, passed through untouched; converting
every completion into another type and back would be O(tokens) work on the scheduler's event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal, Protocol

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2
from services.transports import Receiver, TransportKind
from services.transports.cuda_ipc_fence import Holder

Split = Literal["train", "eval"]


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one generation request (n = the group size)."""

    n: int
    temperature: float
    max_tokens: int
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


@dataclass(frozen=True)
class EnvInfo:
    """What the scheduler needs to know of its environment to run its episodes."""

    name: str = ""
    max_turns: int = 1  # model turns per episode (1 = single-turn: no Respond calls)
    respond_timeout: float = 30.0  # the env's own deadline of one Respond (tools included)
    episode_timeout: float = 0.0  # wall-clock limit of an episode (0 = none)
    max_episode_tokens: int = 0  # token budget of an episode after its prompt (0 = none)
    levels: tuple[str, ...] = ()  # difficulty levels of the train split, easiest first (none: ())
    success_threshold: float = 1.0  # a completion with reward >= this counts as solved


@dataclass(frozen=True)
class Rendered:
    """Tokens (and their text) the rollout rendered through the chat template."""

    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class Scores:
    """The environment's verdict on one group."""

    rewards: list[float]
    reward_infos: Sequence[types_pb2.RewardInfo]
    skip_group: bool  # the env's failure policy says: do not train on this group


@dataclass
class ScoredGroup:
    """A prompt's G scored completions, waiting to be trained on."""

    group_id: str
    prompt: types_pb2.Prompt
    completions: list[types_pb2.Completion]
    rewards: list[float]
    reward_infos: Sequence[types_pb2.RewardInfo] = ()
    versions: AbstractSet[int] = frozenset()  # weight versions that produced its tokens (read once)
    stats: dict[str, float] = field(default_factory=dict)  # its episodes' figures (multi-turn tasks)
    # per-group facts, once for the group (its completions' own copies are cleared: `hoist_facts`)
    prompt_token_ids: Sequence[int] = ()
    sampling_params: types_pb2.SamplingParams | None = None
    rollout_id: str = ""


@dataclass
class Batch:
    """One optimizer step's data: groups and one advantage per completion."""

    batch_id: str
    step: int
    groups: list[ScoredGroup]
    advantages: list[list[float]]


@dataclass(frozen=True)
class StepResult:
    step: int
    weight_version: int
    metrics: dict[str, float] = field(default_factory=dict)
    # the learner's logprob of every completion token of the batch, per completion in the batch's
    # order, under the weights the step started from (TrainStepResponse.completion_logprobs)
    completion_logprobs: Sequence[Sequence[float]] = ()


@dataclass(frozen=True)
class LearnerInfo:
    weight_version: int
    step: int
    loss: str
    last_batch_id: str = ""  # the last batch the learner trained (or its checkpoint consumed)
    lineage_id: str = ""  # the run's learner lineage: kept across restarts from its checkpoints
    instance_id: str = ""  # changes whenever the learner process restarts


@dataclass(frozen=True)
class PreparedWeights:
    """A published version: its number and the message rollouts stage it from (opaque here)."""

    version: int
    message: types_pb2.WeightVersion
    prepare_ms: float
    # how long a rollout's stage of it, and then its commit, may take: derived from its bytes (and a
    # collective transfer's own bound); None: the rollout client's configured transfer deadline
    transfer_timeout: float | None = None


@dataclass(frozen=True)
class TokenScores:
    logprobs: list[float]
    weight_version: int


@dataclass(frozen=True)
class RolloutInfo:
    rollout_id: str
    weight_version: int
    ready: bool  # loaded and accepting work (READY or UPDATING)
    max_in_flight: int
    weight_workers: int = 1  # processes that receive collective weight transfers
    instance_id: str = ""  # changes when the rollout restarts
    max_model_len: int = 0  # longest prompt + completion it accepts (0 = unknown)


class EnvClient(Protocol):
    async def describe(self) -> EnvInfo: ...

    async def sample(
        self, n: int, split: Split, start: int | None = None, level: str | None = None
    ) -> list[types_pb2.Prompt]:
        """`n` prompts (fewer from a finite eval split: never repeated); `start` positions the cursor;
        `level`: from that level's own train stream (`start` is then a position in it)."""

    async def respond(
        self, prompt: types_pb2.Prompt, transcripts: Sequence[types_pb2.Transcript]
    ) -> list[env_pb2.EnvReply]:
        """The environment's turn in each live episode of a group (one reply per transcript)."""

    async def score(self, prompt: types_pb2.Prompt, transcripts: Sequence[types_pb2.Transcript]) -> Scores:
        """One group's episodes, by what was said (the env reads no tokens or logprobs)."""

    async def evaluate(
        self, groups: Sequence[tuple[types_pb2.Prompt, Sequence[types_pb2.Transcript]]]
    ) -> dict[str, float]:
        """Eval metrics (keys `eval/...`) of scored held-out groups."""

    async def close(self) -> None: ...


class LearnerClient(Protocol):
    async def state(self) -> LearnerInfo: ...

    async def train_step(self, batch: Batch) -> StepResult: ...

    async def prepare(
        self, kind: TransportKind, receivers: Sequence[Receiver] = (), holders: Sequence[Holder] | None = None
    ) -> PreparedWeights:
        """Publish the current weights; collective transports need every receiving rollout named.
        `holders`: what each rollout whose version is known for certain serves (the cuda_ipc fence:
        the learner never rewrites a buffer a rollout not listed may still read); None: none listed."""

    async def release(self, version: int) -> None: ...

    async def score_tokens(self, sequence: types_pb2.TokenSequence) -> TokenScores: ...

    async def restore(self, lineage_id: str, max_step: int, min_step: int = 0) -> int:
        """Go back to the newest checkpoint at or before `max_step` (the run's ledger lost the steps
        after it); the step the learner was at before. `state` then says where it is."""

    async def close(self) -> None: ...


class RolloutClient(Protocol):
    async def state(self) -> RolloutInfo: ...

    async def generate(
        self,
        request_id: str,
        prompt: types_pb2.Prompt,
        sampling: Sampling,
        prompt_token_ids: Sequence[int] = (),
    ) -> list[types_pb2.Completion]:
        """All `sampling.n` completions of one prompt (in any order); with `prompt_token_ids`, of
        exactly these tokens (token-in: a later turn of an episode; the completions then carry no
        prompt tokens)."""

    async def render_bridge(
        self, messages: Sequence[types_pb2.ChatMessage], previous_tail: Sequence[int], tools_json: str = ""
    ) -> Rendered:
        """The tokens that append `messages` after a model turn ending in `previous_tail`: the rest of
        the assistant's end of turn, the messages, the next generation prompt. Nothing before is
        rendered again."""

    async def stage(
        self, weights: types_pb2.WeightVersion, deadline_s: float | None = None, rewind: bool = False
    ) -> int:
        """Fetch/receive + verify a version within `deadline_s` (None: the configured transfer deadline
        for its bytes). `rewind`: accept a version not newer than the loaded one (the learner restarted
        from an older checkpoint; the loaded weights belong to a lineage that no longer exists).
        Returns the bytes that reached the rollout (fewer than the version's when sent as deltas)."""

    async def commit(self, version: int, rewind: bool = False, deadline_s: float | None = None) -> None:
        """Load the staged `version` within `deadline_s` (None: the weight-sync deadline; `rewind`: even
        if it is older than the loaded one)."""

    async def abort(self, version: int) -> None: ...

    async def score_tokens(self, sequence: types_pb2.TokenSequence) -> TokenScores: ...

    async def close(self) -> None: ...
