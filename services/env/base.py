"""The plug-in API: the `Environment` base class and the plain data types it speaks.

An environment is two things:

* a **prompt source** — `sample(n, split)` draws prompts from the "train" or "eval" split. The simple
  way to write one is random access: `split_size(split)` (0 = procedural, unbounded) and
  `prompt_at(split, index)`; the base class then gives a seeded, resumable cursor per split (train
  order is reshuffled every epoch from the seed, eval order is fixed). Override `sample` instead for
  any other async source.
* a **scorer** — `score(prompt, completions)` returns one reward per completion (a float, None, or a
  `Score` with the parsed answer and details). It always runs inside an isolated scoring worker
  process (see `scoring.py`), never on the service's event loop; it may be sync or async. The default
  calls `score_one` per completion and records an exception there as that completion's failure.

Optional hooks: `setup()` (load data, runs in the service), `setup_scorer()` (runs once in each
scoring worker), `evaluate(results)` (extra eval metrics), `reference_completion`/`wrong_answers`
(used by `python -m services.env check`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

SplitName = Literal["train", "eval"]
SPLITS: tuple[SplitName, ...] = ("train", "eval")


class NoOptions(BaseModel):
    """Options model of an environment that takes none (unknown keys are rejected)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class PromptItem:
    """One task instance. Exactly one of `text` / `messages` is set (messages: [{"role", "content"}])."""

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


class Environment:
    """Base class of every environment. Subclass it, set `name`/`Options`, implement source and scorer."""

    name: ClassVar[str] = "custom"
    description: ClassVar[str] = ""
    # Pydantic model of the env's options; `--env-arg k=v` and the run config are validated against it.
    Options: ClassVar[type[BaseModel]] = NoOptions
    # Rewards outside [low, high] are recorded as scoring failures.
    reward_range: ClassVar[tuple[float, float]] = (-math.inf, math.inf)
    # A completion with reward >= this counts as solved (accuracy and pass@k in evaluation).
    success_threshold: ClassVar[float] = 1.0

    def __init__(self, options: BaseModel | None = None) -> None:
        self.options = options if options is not None else self.Options()
        self._positions: dict[str, int] = dict.fromkeys(SPLITS, 0)
        self._order: tuple[tuple[int, int], list[int]] | None = None  # train permutation of one epoch

    # ----------------------------------------------------------------- lifecycle hooks
    async def setup(self) -> None:
        """Prepare the prompt source (load a dataset). Runs once in the service process."""

    def setup_scorer(self) -> None:
        """Prepare scoring (load a verifier). Runs once in every scoring worker process."""

    @property
    def seed(self) -> int:
        return int(getattr(self.options, "seed", 0))

    def options_dict(self) -> dict[str, Any]:
        """The resolved options, for DescribeEnvironment and logs."""
        return self.options.model_dump(mode="json")

    # ----------------------------------------------------------------- prompt source
    def split_size(self, split: SplitName) -> int:
        """Number of prompts in the split; 0 = procedural (unbounded)."""
        return 0

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        """The index-th prompt of the split (random access). Override this or `sample`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither prompt_at nor sample")

    def _ordered_index(self, split: SplitName, position: int) -> int:
        """Map a cursor position to an item index: epoch-wise seeded shuffle for train, identity for eval."""
        size = self.split_size(split)
        if size == 0:
            return position
        epoch, offset = divmod(position, size)
        if split == "eval":
            return offset
        key = (size, epoch)
        if self._order is None or self._order[0] != key:
            order = list(range(size))
            random.Random(f"{self.name}/{self.seed}/epoch/{epoch}").shuffle(order)
            self._order = (key, order)
        return self._order[1][offset]

    def _take(self, split: SplitName, start: int, n: int) -> list[PromptItem]:
        return [self.prompt_at(split, self._ordered_index(split, start + i)) for i in range(n)]

    async def sample(self, n: int, split: SplitName = "train", start: int | None = None) -> list[PromptItem]:
        """Draw `n` prompts and advance the split's cursor. `start` moves the cursor first (resume, eval)."""
        position = self._positions[split] if start is None else start
        self._positions[split] = position + n
        return await asyncio.to_thread(self._take, split, position, n)

    def position(self, split: SplitName) -> int:
        return self._positions[split]

    def state(self) -> dict[str, int]:
        """Resumable state: the cursor of each split."""
        return dict(self._positions)

    def load_state(self, state: dict[str, int]) -> None:
        for split in SPLITS:
            if split in state:
                self._positions[split] = int(state[split])

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
                message = f"{type(exc).__name__}: {exc}"
                scores.append(Score(reward=None, failure=message, details={"failure_kind": "exception"}))
        return scores

    def score_one(self, prompt: PromptItem, completion: str) -> Score | float | None:
        """Score one completion. Override this or `score`."""
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
