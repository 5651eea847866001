"""The `arithmetic` built-in: procedural integer arithmetic, the embedded default task.

The format is fixed because the tiny test model is warm-started on it: the prompt is the expression
with no spaces followed by "=" (e.g. "37+45="), the expected completion is the exact integer result
(e.g. "82", or "-8") followed by EOS. Scoring strips whitespace, takes the leading integer
(`^-?\\d+`) of the completion and gives 1.0 on an exact match, else 0.0 — or, with
`partial_credit`, the fraction of right-aligned characters (sign included) that match.

Difficulty levels (`levels="1,2,3,4"`, or `"1-4"`): digit counts, each level a train stream of problems whose
operands have at most that many digits (level "3" = `digits=3`), for a curriculum; the eval split
stays the `digits` option (`digits=4, levels=1,2,3,4`: held out on the hardest level). Empty (the
default) = no levels.

`make_problem` and `score_answer` are pure functions so the tiny-model builder and the tests can use
them without the service.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.env.base import Environment, PromptItem, Score, SplitName

_ALLOWED_OPERATORS = "+-*"
_LEADING_INT = re.compile(r"^-?\d+")


class ArithmeticOptions(BaseModel):
    """Difficulty knobs and split settings of the arithmetic task."""

    model_config = ConfigDict(extra="forbid")

    digits: int = Field(default=2, ge=1, le=9, description="Each operand has at most this many digits.")
    terms: int = Field(default=2, ge=2, le=8, description="Number of operands in the expression.")
    operators: str = Field(default="+-", description="Operators to draw from, any of '+', '-', '*'.")
    partial_credit: bool = Field(
        default=False, description="Give a fraction of matching digits instead of 0 for wrong answers."
    )
    seed: int = Field(default=0, description="Seed of the train stream (the eval split uses a derived seed).")
    eval_size: int = Field(default=200, ge=0, description="Number of held-out eval problems.")
    levels: str = Field(
        default="",
        description="Difficulty levels of the train split, as digit counts: '1,2,3,4' or '1-4'; "
        "each level draws operands of at most that many digits. Empty = no levels (train at `digits`).",
    )

    @field_validator("operators")
    @classmethod
    def _check_operators(cls, value: str) -> str:
        return check_operators(value)

    @field_validator("levels")
    @classmethod
    def _check_levels(cls, value: str) -> str:
        return ",".join(str(d) for d in level_digits(value))


def check_operators(value: str) -> str:
    """An `operators` option: non-empty, only '+', '-' and '*' (a pydantic validator's body)."""
    if not value:
        raise ValueError("operators must not be empty")
    bad = sorted(set(value) - set(_ALLOWED_OPERATORS))
    if bad:
        raise ValueError(f"unsupported operator(s) {bad!r}; allowed: {_ALLOWED_OPERATORS!r}")
    return value


def level_digits(value: str) -> list[int]:
    """The digit counts of a `levels` option, in order: "1,2,3", or a range "1-4" (what a command line
    that splits lists at commas can pass), or both ("1-3,5"); distinct, each in [1, 9]."""
    digits: list[int] = []
    for part in (p.strip() for p in value.split(",")):
        if not part:
            continue
        low, dash, high = part.partition("-")
        if not (low.strip().isdigit() and (not dash or high.strip().isdigit())):
            raise ValueError(f"levels must be digit counts like '1,2,3,4' or '1-4', got {value!r}")
        digits += range(int(low), int(high or low) + 1)
    if not all(1 <= d <= 9 for d in digits) or len(set(digits)) != len(digits):
        raise ValueError(f"levels must be distinct digit counts in [1, 9], got {value!r}")
    return digits


def evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Evaluate with the usual precedence (* before + and -), left to right otherwise."""
    terms: list[int] = [operands[0]]
    signs: list[int] = [1]
    for op, value in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms, strict=True))


def make_problem(rng: random.Random, options: ArithmeticOptions) -> tuple[str, str]:
    """Draw one problem: (prompt_text like "37+45=", answer_text like "82" or "-8")."""
    high = 10**options.digits - 1
    operands = [rng.randint(0, high) for _ in range(options.terms)]
    ops = [rng.choice(options.operators) for _ in range(options.terms - 1)]
    expression = str(operands[0]) + "".join(
        op + str(value) for op, value in zip(ops, operands[1:], strict=True)
    )
    return expression + "=", str(evaluate(operands, ops))


def parse_answer(completion: str) -> str | None:
    """The leading integer of the completion after stripping whitespace, or None."""
    match = _LEADING_INT.match(completion.strip())
    return match.group(0) if match else None


def _partial(predicted: str, answer: str) -> float:
    """Fraction of right-aligned characters (digits and sign) that agree, over the longer length."""
    width = max(len(predicted), len(answer))
    matches = sum(1 for a, b in zip(reversed(predicted), reversed(answer), strict=False) if a == b)
    return matches / width


def score_answer(completion: str, answer: str, partial_credit: bool = False) -> tuple[float, str | None]:
    """Reward of one completion and the parsed answer (None if no leading integer)."""
    predicted = parse_answer(completion)
    if predicted is None:
        return 0.0, None
    if int(predicted) == int(answer):
        return 1.0, predicted
    return (_partial(predicted, answer) if partial_credit else 0.0), predicted


def _problem_rng(seed: int, split: str, index: int) -> random.Random:
    """Independent stream per (seed, split, index): positions are resumable and splits disjoint-seeded."""
    return random.Random(f"arithmetic/{seed}/{split}/{index}")


def problem_at(options: ArithmeticOptions, split: str, index: int) -> tuple[str, str]:
    """The index-th problem of a split (deterministic, random access)."""
    return make_problem(_problem_rng(options.seed, split, index), options)


class ArithmeticEnv(Environment[ArithmeticOptions]):
    """Procedural integer arithmetic; the eval split is the first `eval_size` problems of its own stream."""

    name: ClassVar[str] = "arithmetic"
    description: ClassVar[str] = "Procedural integer arithmetic ('37+45=' -> '82'), exact-match reward."
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def split_size(self, split: SplitName) -> int:
        return 0 if split == "train" else self.options.eval_size

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        text, answer = problem_at(self.options, split, index)
        return self.render(f"{self.name}-{split}-{index}", text, answer)

    def render(self, prompt_id: str, text: str, answer: str) -> PromptItem:
        """The prompt of one problem ("37+45=", "82"): here the bare expression; a subclass may ask it
        otherwise (in chat: services/launch/pretrained.py), for the train split, each level and eval."""
        return PromptItem(id=prompt_id, text=text, reference_answer=answer)

    def levels(self) -> list[str]:
        return [str(d) for d in level_digits(self.options.levels)]

    def level_prompt_at(self, level: str, index: int) -> PromptItem:
        options = self.options.model_copy(update={"digits": int(level)})
        text, answer = make_problem(_problem_rng(self.options.seed, f"train-d{level}", index), options)
        return self.render(f"{self.name}-train-d{level}-{index}", text, answer)

    def score_one(self, prompt: PromptItem, completion: str) -> Score:
        reward, parsed = score_answer(completion, prompt.reference_answer, self.options.partial_credit)
        details = {} if parsed is not None else {"reason": "no leading integer"}
        return Score(reward=reward, parsed_answer=parsed or "", details=details)

    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        answer = int(prompt.reference_answer)
        return [str(answer + 1), "", "x" + str(answer)]
