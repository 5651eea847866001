"""The plug-in API: the stateless `Environment` base class and the plain data types it speaks.

An environment is two things, and keeps no service state for either:

* a **prompt source**. The simple way is random access: `split_size(split)` (0 = procedural,
  unbounded) and `prompt_at(split, index)`. For a source without random access, override
  `sample(n, split, start)` instead. Either way the service's `PromptCursor` (cursor.py) owns the
  positions: it remembers where each split is, shuffles train order per epoch, replays eval from 0
  and resumes from a saved position, so the same environment object can serve any position.
* a **scorer**. `score(prompt, completions)` returns one reward per completion (a float, None, or a
  `Score` with the parsed answer and details). It always runs inside an isolated scoring worker
  process (see `scoring.py`), never on the service's event loop; it may be sync or async. The default
  calls `score_one` per completion and records an exception there as that completion's failure
  (kind "exception").

Options are a pydantic model: write `class MyEnv(Environment[MyOptions])` and `self.options` is a
`MyOptions` (and `Options` is taken from the type parameter); the older `Options: ClassVar[...] = X`
form on an unparametrised subclass works too.

A **multi-turn** environment (tools, feedback, a simulated user) adds one stateless method:
`respond(prompt, transcript)` answers the model's latest turn, given everything said after the prompt
(`transcript`: assistant, tool and user messages as dicts), with a `Reply`: messages to append, or
`done`. The transcript is the whole state, so any scoring worker can answer any turn of any episode
and an environment killed mid-episode loses nothing. The default `respond` runs the tool calls of the
model's last message (`tools()`: Python callables with type hints; `services/env/tools/`) and returns
their results, and ends the episode when the model calls no tool. `max_turns` bounds the model turns
(1 = single-turn: `respond` is never called). The episode is scored on its final transcript:
`score_episodes(prompt, transcripts)`, by default `score` on each final assistant message's text, so a
single-turn environment is the one-turn case of the same path. The framework owns the tokens: it
appends the environment's messages as tokens after the model's sampled ones and never re-renders the
conversation (docs/agents.md).

**Difficulty levels** (optional, for a curriculum): `levels()` names the train split's levels, easiest
first (empty by default), and `level_prompt_at(level, index)` is the index-th prompt of one level's
own train stream (`level_size(level)`: 0 = procedural, the default). With levels, the cursor serves
the train split through them: a draw naming a level reads that level's stream, and the train stream
without a level interleaves the levels round-robin (position p is position p // K of level p % K),
so it is uniform over levels; every train prompt carries `metadata["level"]`. `prompt_at("train", …)`
is then never called; the eval split is unchanged.

Optional hooks: `setup()` (load data, runs in the service), `setup_scorer()` (runs once in each
scoring worker), `evaluate(results)` (extra eval metrics), `reference_completion`/`wrong_answers`
(used by `grpo-mesh check-env`), `options_dict()` (what DescribeEnvironment shows).
"""

from __future__ import annotations

import inspect
import math
import numbers
import typing
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar, cast

from pydantic import BaseModel, ConfigDict

from services.env.turns import Message, Reply, final_text

SplitName = Literal["train", "eval"]
SPLITS: tuple[SplitName, ...] = ("train", "eval")


class NoOptions(BaseModel):
    """Options model of an environment that takes none (unknown keys are rejected)."""

    model_config = ConfigDict(extra="forbid")


OptionsT = TypeVar("OptionsT", bound=BaseModel)


@dataclass(frozen=True)
class PromptItem:
    """One task instance, as served to the rollout and handed back to the scorer.

    id: unique within its split (the service appends "@<position>" to train ids of finite data).
    text / messages: exactly one is set; text is fed to the model as is, messages
        ({"role", "content"} dicts) go through the model's chat template.
    reference_answer: the expected answer (for scorers, `check`, and reward functions' `answer`).
    metadata: free str → str pairs the env sets in `prompt_at`/`sample` (e.g. {"split": "train",
        "index": "7"}); they travel with the prompt and reach `score_one` unchanged, and TRL-style
        reward functions receive each key as a column.
    """

    id: str
    text: str = ""
    messages: tuple[dict[str, str], ...] = ()
    reference_answer: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)


@dataclass
class Score:
    """The outcome of scoring one completion. `reward=None` means "could not score" (a failure)."""

    reward: float | None
    parsed_answer: str = ""
    details: dict[str, str] = field(default_factory=dict)
    failure: str = ""


def failure(kind: str, message: str) -> Score:
    """A failed score of the given kind: failure text "<kind>: <message>", details["failure_kind"] = kind.

    `details["failure_kind"]` is what failure counters are keyed by (`env/failures.<kind>`); every
    failed score the service reports has one. The "<kind>: " text prefix is only on the failures
    built here (a raising `score_one`, a timed-out or crashed worker, a NaN or out-of-range reward,
    ...). Other failures keep their own text: a scorer's own `Score.failure`, `as_score`'s "scorer
    returned None", a reward-function sum's "<term>: <failure>" parts. Read the kind from details,
    not from the text.
    """
    return Score(reward=None, failure=f"{kind}: {message}", details={"failure_kind": kind})


@dataclass
class GroupResult:
    """One prompt with its completions and their (validated) scores, as seen by `evaluate`."""

    prompt: PromptItem
    completions: list[str]
    scores: list[Score]


def as_score(value: Any) -> Score:
    """Normalise what a scorer returned for one completion (float, int, bool, None or Score)."""
    if isinstance(value, Score):
        return value
    if value is None:
        return Score(reward=None, failure="scorer returned None", details={"failure_kind": "no_reward"})
    if isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
        return Score(reward=float(value))
    message = f"scorer returned {type(value).__name__}, expected a number or Score"
    return Score(reward=None, failure=message, details={"failure_kind": "bad_output"})


class Scorer(Protocol):
    """What scores completions: an `Environment` itself, or a `rewards.RewardFunctionScorer` around one."""

    @property
    def reward_range(self) -> tuple[float, float]: ...

    @property
    def success_threshold(self) -> float: ...

    def setup_scorer(self) -> None: ...

    def score(
        self, prompt: PromptItem, completions: Sequence[str]
    ) -> Awaitable[list[Score | float | None]]: ...

    def reference_completion(self, prompt: PromptItem) -> str: ...

    def wrong_answers(self, prompt: PromptItem) -> list[str]: ...

    def options_dict(self) -> dict[str, Any]: ...


class Environment(Generic[OptionsT]):
    """Base class of every environment. Subclass it (`Environment[MyOptions]`), set `name`, implement
    a prompt source (`split_size` + `prompt_at`, or `sample`) and a scorer (`score_one` or `score`)."""

    name: ClassVar[str] = "custom"
    description: ClassVar[str] = ""
    # Pydantic model of the env's options; `--env-arg k=v` and the run config are validated against it.
    # Taken from the type parameter (`Environment[MyOptions]`) when a subclass does not set it.
    Options: ClassVar[type[BaseModel]] = NoOptions
    # Rewards outside [low, high] are recorded as scoring failures.
    reward_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)
    # A completion with reward >= this counts as solved (accuracy and pass@k in evaluation).
    success_threshold: ClassVar[float] = 1.0
    # Multi-turn: model turns per episode (1 = single-turn; an option named `max_turns` overrides it),
    # the deadline of one `respond` (tools included), of a tool call, of a whole episode (0 = none),
    # and the episode's token budget after the prompt (0 = the rollout's max_tokens per turn only).
    max_turns: ClassVar[int] = 1
    respond_timeout: ClassVar[float] = 30.0
    tool_timeout: ClassVar[float] = 10.0
    episode_timeout: ClassVar[float] = 0.0
    max_episode_tokens: ClassVar[int] = 0

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "Options" not in cls.__dict__:
            declared = _options_parameter(cls)
            if declared is not None:
                cls.Options = declared

    def __init__(self, options: OptionsT | None = None) -> None:
        self.options: OptionsT = options if options is not None else cast(OptionsT, self.Options())

    # ----------------------------------------------------------------- lifecycle hooks
    async def setup(self) -> None:
        """Prepare the prompt source (load a dataset). Runs once in the service process."""

    def setup_scorer(self) -> None:
        """Prepare scoring (load a verifier). Runs once in every scoring worker process."""

    @property
    def seed(self) -> int:
        """The `seed` option when the env has one (it keys the train shuffle), else 0."""
        return int(getattr(self.options, "seed", 0))

    def options_dict(self) -> dict[str, Any]:
        """The resolved options, for DescribeEnvironment and logs."""
        return self.options.model_dump(mode="json")

    @property
    def turn_limit(self) -> int:
        """Model turns per episode: the `max_turns` option when the env has one, else the class's."""
        return int(getattr(self.options, "max_turns", type(self).max_turns))

    # ----------------------------------------------------------------- multi-turn (runs in a worker process)
    def tools(self) -> Sequence[Callable[..., Any]]:
        """Tools the model may call: Python callables with type hints and a docstring (their JSON schema
        is built from them and rendered into the prompt by the chat template). Default: none."""
        return ()

    async def respond(self, prompt: PromptItem, transcript: list[Message]) -> Reply:
        """The environment's answer to the model's last turn (`transcript[-1]`, an assistant message).

        Default: run the tool calls in it and return one tool message per call (a malformed or failing
        call becomes an error message the model reads, never an exception); no tool call ends the
        episode. Override for feedback turns or a simulated user; call `run_tools` for the tool part.
        """
        from services.env.episodes import run_tools  # the toolbox is imported only where tools run

        return await run_tools(self, transcript)

    async def score_episodes(
        self, prompt: PromptItem, transcripts: Sequence[Sequence[Message]]
    ) -> list[Score | float | None]:
        """One score per episode. Default: `score` on each episode's final assistant text."""
        return await self.score(prompt, [final_text(t) for t in transcripts])

    # ----------------------------------------------------------------- prompt source
    def split_size(self, split: SplitName) -> int:
        """Number of prompts in the split; 0 = procedural (unbounded)."""
        return 0

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        """The index-th prompt of the split (random access, deterministic). Override this or `sample`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither prompt_at nor sample")

    async def sample(self, n: int, split: SplitName, start: int) -> list[PromptItem]:
        """The `n` prompts at positions start, start+1, … of `split`, for sources without random access.

        Override this instead of `prompt_at`; it is used only when overridden. The service's cursor owns
        the positions and passes `start` explicitly (it advances by the number of prompts returned), so
        keep no cursor here: the same `(split, start)` must give the same prompts, which is what makes
        a run resumable. Positions are in the source's own order (the cursor does not shuffle them).
        """
        raise NotImplementedError(f"{type(self).__name__} implements neither prompt_at nor sample")

    # ----------------------------------------------------------------- difficulty levels (optional)
    def levels(self) -> Sequence[str]:
        """Names of the train split's difficulty levels, easiest first; empty (the default) = none."""
        return ()

    def level_size(self, level: str) -> int:
        """Number of prompts of one level's train stream; 0 (the default) = procedural (unbounded)."""
        return 0

    def level_prompt_at(self, level: str, index: int) -> PromptItem:
        """The index-th prompt of `level`'s own train stream (deterministic). Implement it with `levels`."""
        raise NotImplementedError(f"{type(self).__name__} declares levels but implements no level_prompt_at")

    # ----------------------------------------------------------------- scorer (runs in a worker process)
    async def score(self, prompt: PromptItem, completions: Sequence[str]) -> list[Score | float | None]:
        """One score per completion, in order. Default: `score_one` each; an exception fails only that one."""
        scores: list[Score | float | None] = []
        for completion in completions:
            try:
                result = self.score_one(prompt, completion)
                if inspect.isawaitable(result):
                    result = await result
                scores.append(result)
            except NotImplementedError:
                raise
            except Exception as exc:
                scores.append(failure("exception", f"{type(exc).__name__}: {exc}"))
        return scores

    def score_one(self, prompt: PromptItem, completion: str) -> Score | float | None:
        """Score one completion (its decoded text, as generated). Override this or `score`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither score_one nor score")

    # ----------------------------------------------------------------- evaluation and smoke-test hooks
    def evaluate(self, results: list[GroupResult]) -> dict[str, float]:
        """Extra eval metrics from scored eval groups (standard accuracy/mean/pass@k are computed anyway)."""
        return {}

    def reference_completion(self, prompt: PromptItem) -> str:
        """A completion that must score `success_threshold` or more (smoke test)."""
        return prompt.reference_answer

    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        """Completions that must score below `success_threshold` (smoke test)."""
        return ["", "I do not know."]


def _options_parameter(cls: type) -> type[BaseModel] | None:
    """The options model named by `class X(Environment[MyOptions])` (or a generic subclass's parameter)."""
    for base in cls.__dict__.get("__orig_bases__", ()):
        origin = typing.get_origin(base)
        if isinstance(origin, type) and issubclass(origin, Environment):
            for arg in typing.get_args(base):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    return arg
    return None


def has_own_sample(env: Environment[Any]) -> bool:
    """True when the env overrides `sample` (a source without random access)."""
    return type(env).sample is not Environment.sample
