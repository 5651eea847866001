"""The `guessing` built-in: a number-guessing game with feedback turns (multi-turn, no tools).

The environment thinks of a number in [1, `high`] (8 by default), drawn from (seed, split, index), so
the same prompt always hides the same number; the number travels in the prompt's metadata
(`target`) and as its reference answer. The environment keeps no state: the transcript is the game.

Each model turn must hold a guess: its last integer. `respond` answers with a user message,
"Higher." when the guess is too low, "Lower." when too high, or a reminder when the turn holds no
integer; a right guess ends the episode. At most `max_turns` model turns (4 by default: enough for
binary search over 1..8, which needs at most 4).

Reward: 0.0 when no turn within `max_turns` guessed the number; a success at model turn k earns
1 − discount·(k − 1)/(max_turns − 1), from 1.0 (first guess) down to 1 − discount (last allowed turn).
`discount` is 0 by default (every success is worth 1.0) and at most 0.5, so a success always scores
at least 0.5, the success threshold, and a failure 0.

`reference_episode` (binary search) and `wrong_episodes` are what `grpo-mesh check-env` plays.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.env.base import Environment, Message, PromptItem, Reply, Score, SplitName

_INTEGER = re.compile(r"-?\d+")

DEFAULT_SYSTEM_PROMPT = "You are playing a number guessing game. Reply with one number only."
DEFAULT_QUESTION = (
    "I am thinking of a whole number between 1 and {high}. Guess it! After each guess I will say "
    '"Higher." if my number is bigger or "Lower." if it is smaller. What is your first guess?'
)


class GuessingOptions(BaseModel):
    """Size of the game, turn budget, reward shaping and phrasing."""

    model_config = ConfigDict(extra="forbid")

    high: int = Field(default=8, ge=2, le=1_000_000, description="The number is drawn from 1..high.")
    max_turns: int = Field(default=4, ge=1, le=32, description="Guesses (model turns) per episode.")
    discount: float = Field(
        default=0.0, ge=0.0, le=0.5, description="Reward lost by a success on the last turn vs the first."
    )
    seed: int = Field(default=0, description="Seed of the train stream (the eval split uses its own stream).")
    eval_size: int = Field(default=200, ge=0, description="Number of held-out eval games.")
    question: str = Field(
        default=DEFAULT_QUESTION, description="The opening user message; {high} is filled in."
    )
    system_prompt: str | None = Field(
        default=DEFAULT_SYSTEM_PROMPT, description="System message; none = the chat template's default."
    )

    @model_validator(mode="after")
    def _check_question(self) -> GuessingOptions:
        try:
            self.question.format(high=self.high)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"question may only use the placeholder {{high}}: {exc}") from None
        return self


def target_at(options: GuessingOptions, split: str, index: int) -> int:
    """The hidden number of a split's index-th game (deterministic)."""
    return random.Random(f"guessing/{options.seed}/{split}/{index}").randint(1, options.high)


def guess_of(text: str) -> int | None:
    """The guess in a model turn: its last integer, or None."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def binary_search(high: int, target: int) -> list[int]:
    """The guesses binary search over 1..high makes to find `target` (the last one is `target`)."""
    low, guesses = 1, []
    while True:
        guess = (low + high) // 2
        guesses.append(guess)
        if guess == target:
            return guesses
        low, high = (guess + 1, high) if guess < target else (low, guess - 1)


def _guesses(transcript: Sequence[Message]) -> list[int | None]:
    return [guess_of(str(m.get("content") or "")) for m in transcript if m.get("role") == "assistant"]


class GuessingEnv(Environment[GuessingOptions]):
    """Guess a hidden number with "Higher." / "Lower." feedback; reward for finding it in time."""

    name: ClassVar[str] = "guessing"
    description: ClassVar[str] = "Guess a number in 1..high with Higher/Lower feedback turns (no tools)."
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    success_threshold: ClassVar[float] = 0.5
    max_turns: ClassVar[int] = 4

    def split_size(self, split: SplitName) -> int:
        return 0 if split == "train" else self.options.eval_size

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        target = target_at(self.options, split, index)
        messages: list[dict[str, str]] = []
        if self.options.system_prompt:
            messages.append({"role": "system", "content": self.options.system_prompt})
        messages.append({"role": "user", "content": self.options.question.format(high=self.options.high)})
        return PromptItem(
            id=f"{self.name}-{split}-{index}",
            messages=tuple(messages),
            reference_answer=str(target),
            metadata={"target": str(target), "high": str(self.options.high)},
        )

    async def respond(self, prompt: PromptItem, transcript: list[Message]) -> Reply:
        """ "Higher." / "Lower." / a reminder as a user message, or done on a right guess."""
        guesses = _guesses(transcript)
        guess = guesses[-1] if guesses else None
        target = int(prompt.metadata["target"])
        if guess == target:
            return Reply(done=True)
        if guess is None:
            text = f"Please guess a whole number between 1 and {prompt.metadata['high']}."
        else:
            text = "Higher." if guess < target else "Lower."
        return Reply(messages=[{"role": "user", "content": text}])

    def _reward(self, target: int, guesses: Sequence[int | None]) -> Score:
        limit = self.turn_limit
        for turn, guess in enumerate(guesses[:limit], start=1):
            if guess == target:
                fraction = (turn - 1) / (limit - 1) if limit > 1 else 0.0
                reward = 1.0 - self.options.discount * fraction
                return Score(reward=reward, parsed_answer=str(guess), details={"turns": str(turn)})
        last = next((g for g in reversed(guesses) if g is not None), None)
        return Score(
            reward=0.0, parsed_answer="" if last is None else str(last), details={"turns": str(len(guesses))}
        )

    async def score_episodes(
        self, prompt: PromptItem, transcripts: Sequence[Sequence[Message]]
    ) -> list[Score | float | None]:
        target = int(prompt.metadata["target"])
        return [self._reward(target, _guesses(transcript)) for transcript in transcripts]

    def score_one(self, prompt: PromptItem, completion: str) -> Score:
        """A single message scored as a one-turn game."""
        return self._reward(int(prompt.metadata["target"]), [guess_of(completion)])

    # ----------------------------------------------------------------- check-env hooks
    def reference_completion(self, prompt: PromptItem) -> str:
        return prompt.metadata["target"]

    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        return [str(self._wrong(prompt)), "", "I do not know."]

    def _wrong(self, prompt: PromptItem) -> int:
        target = int(prompt.metadata["target"])
        return target + 1 if target < self.options.high else target - 1

    def reference_episode(self, prompt: PromptItem) -> list[str]:
        """Binary search, cut to fit `max_turns` (then the last allowed turn names the number)."""
        guesses = binary_search(self.options.high, int(prompt.metadata["target"]))
        if len(guesses) > self.turn_limit:
            guesses = [*guesses[: self.turn_limit - 1], guesses[-1]]
        return [f"My guess is {guess}." for guess in guesses]

    def wrong_episodes(self, prompt: PromptItem) -> list[list[str]]:
        """Never the number: the same wrong guess every turn, and turns with no guess at all."""
        limit = self.turn_limit
        return [[str(self._wrong(prompt))] * limit, ["I do not know."] * limit]
