"""A custom environment for grpo-mesh, in both plug-in forms (see docs/environments.md).

1. An `Environment` subclass with its own options (prompt source + scorer):

       grpo-mesh check-env examples/my_env.py:CountLettersEnv --n 8 --env-arg letter=s
       python -m services.env --spec examples/my_env.py:CountLettersEnv --env-arg letter=s

2. A TRL-style reward function, added to any environment's reward with a weight:

       grpo-mesh check-env arithmetic --reward-funcs examples/my_env.py:brevity --reward-weights 0.1
"""

from __future__ import annotations

import random
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from services.env.base import Environment, GroupResult, PromptItem, Score, SplitName

WORDS = [
    "mississippi",
    "assess",
    "banana",
    "possess",
    "letters",
    "grass",
    "lesson",
    "kiss",
    "stress",
    "chess",
]


class CountLettersOptions(BaseModel):
    """Options are validated by this model: `--env-arg letter=s` or `[env.env_args] letter = "s"`."""

    model_config = ConfigDict(extra="forbid")

    letter: str = Field(default="s", min_length=1, max_length=1, description="Letter to count.")
    words: int = Field(default=2, ge=1, le=5, description="Words per prompt.")
    seed: int = Field(default=0, description="Seed of the prompt stream.")
    eval_size: int = Field(default=50, ge=0, description="Held-out prompts.")


class CountLettersEnv(Environment):
    """How many times does a letter occur in a few words? Reward 1 for the exact count."""

    name: ClassVar[str] = "count_letters"
    description: ClassVar[str] = "Count a letter in some words; answer with the number."
    Options: ClassVar[type[BaseModel]] = CountLettersOptions
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    # Prompt source: random access, stateless. The service's PromptCursor (services/env/cursor.py)
    # owns each split's position: it shuffles train per epoch, replays eval and resumes runs.
    def split_size(self, split: SplitName) -> int:
        return 0 if split == "train" else self.options.eval_size  # 0 = procedural (unbounded)

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        rng = random.Random(f"{self.options.seed}/{split}/{index}")
        words = " ".join(rng.choice(WORDS) for _ in range(self.options.words))
        answer = str(words.count(self.options.letter))
        question = (
            f"How many times does the letter '{self.options.letter}' occur in: {words}? Answer with a number."
        )
        return PromptItem(
            id=f"count_letters-{split}-{index}",
            messages=({"role": "user", "content": question},),  # chat prompt: the chat template applies
            reference_answer=answer,
        )

    # Scorer: runs in an isolated worker process. Return a float, None (= failure) or a Score.
    def score_one(self, prompt: PromptItem, completion: str) -> Score:
        tokens = completion.strip().split()
        guess = tokens[0].strip(".") if tokens else ""
        if not guess.isdigit():
            return Score(reward=0.0, details={"reason": "no number at the start"})
        return Score(reward=float(guess == prompt.reference_answer), parsed_answer=guess)

    # Optional: extra eval metrics on top of accuracy / mean reward / pass@k.
    def evaluate(self, results: list[GroupResult]) -> dict[str, float]:
        answered = [s for g in results for s in g.scores if s.parsed_answer]
        total = sum(len(g.scores) for g in results)
        return {"answered_rate": len(answered) / total if total else 0.0}

    # Optional: what `grpo-mesh check-env` treats as wrong.
    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        return [str(int(prompt.reference_answer) + 1), "many"]


def brevity(prompts, completions, **kwargs) -> list[float]:
    """TRL-style reward function: 1.0 for completions of at most 8 characters, else 0.0."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if len(t.strip()) <= 8 else 0.0 for t in texts]
