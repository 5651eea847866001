"""Plain reward functions (TRL's convention) and their combination with any prompt source.

A reward function is `f(prompts, completions, **columns) -> list[float | None]`, exactly like TRL's
`GRPOTrainer(reward_funcs=...)`: `prompts` and `completions` have one entry per completion (the prompt
repeated); for chat prompts a prompt is its message list and a completion is
`[{"role": "assistant", "content": text}]`, otherwise both are strings. `columns` holds the prompt's
metadata keys plus `reference_answer` (and `answer`, unless metadata has one), each repeated per
completion. `None` means "not applicable to this completion"; the weighted sum skips it, and a
completion no function applies to is a scoring failure.

`RewardFunctionEnvironment` puts a source environment's prompts together with weighted reward
functions (optionally keeping the source's own reward as one more weighted term). When a built-in
answer-in-tags format reward (`answer_tags`, `think_answer`) is among them, the source's scorer sees
the content of the last <answer>...</answer> block (the whole completion if there is none).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from services.env.base import Environment, GroupResult, PromptItem, Score, SplitName, as_score

RewardFunc = Callable[..., Sequence[float | None]]

_ANSWER_TAGS = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_ANSWER = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


def _texts(completions: Sequence[Any]) -> list[str]:
    """Completion strings from either TRL completion form."""
    return [c if isinstance(c, str) else str(c[-1].get("content", "")) if c else "" for c in completions]


def answer_tags(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """Format reward: 1.0 if the completion contains exactly one <answer>...</answer> block, else 0.0."""
    return [1.0 if len(_ANSWER_TAGS.findall(text)) == 1 else 0.0 for text in _texts(completions)]


def think_answer(prompts: Sequence[Any], completions: Sequence[Any], **_: Any) -> list[float]:
    """Format reward: 1.0 if the completion is exactly <think>...</think> then <answer>...</answer>."""
    return [1.0 if _THINK_ANSWER.match(text) else 0.0 for text in _texts(completions)]


# Built-in reward functions, addressable by bare name in `reward_funcs`.
BUILTIN_REWARDS: dict[str, RewardFunc] = {"answer_tags": answer_tags, "think_answer": think_answer}
_BUILTIN_RANGES: dict[str, tuple[float, float]] = {"answer_tags": (0.0, 1.0), "think_answer": (0.0, 1.0)}


def extract_answer_tag(text: str) -> str | None:
    """The content of the last <answer>...</answer> block, stripped, or None."""
    found = _ANSWER_TAGS.findall(text)
    return found[-1].strip() if found else None


def func_name(func: Callable[..., Any]) -> str:
    return getattr(func, "__name__", type(func).__name__)


def call_reward_func(func: RewardFunc, prompt: PromptItem, completions: Sequence[str]) -> list[float | None]:
    """Call one TRL-style reward function for one group and check the shape of what it returns."""
    n = len(completions)
    if prompt.is_chat:
        prompts: list[Any] = [list(prompt.messages)] * n
        comps: list[Any] = [[{"role": "assistant", "content": c}] for c in completions]
    else:
        prompts, comps = [prompt.text] * n, list(completions)
    columns: dict[str, list[Any]] = {key: [value] * n for key, value in prompt.metadata.items()}
    columns.setdefault("answer", [prompt.reference_answer] * n)
    columns["reference_answer"] = [prompt.reference_answer] * n
    out = func(prompts=prompts, completions=comps, **columns)
    if inspect.isawaitable(out):
        raise TypeError(
            f"reward function {func_name(func)} returned an awaitable; use an Environment for async"
        )
    out = list(out)
    if len(out) != n:
        raise ValueError(f"reward function {func_name(func)} returned {len(out)} values for {n} completions")
    return out


def combine(parts: list[tuple[str, float, list[Score]]], n: int) -> list[Score]:
    """Weighted sum per completion over the parts that gave a reward; a failure in any part fails it."""
    combined: list[Score] = []
    for i in range(n):
        total, applied, failures = 0.0, 0, []
        details: dict[str, str] = {}
        parsed = ""
        for name, weight, scores in parts:
            score = scores[i]
            details.update({f"{name}.{k}": v for k, v in score.details.items() if k != "failure_kind"})
            parsed = parsed or score.parsed_answer
            if score.failure:
                failures.append(f"{name}: {score.failure}")
                continue
            if score.reward is None:
                continue
            details[f"reward.{name}"] = repr(score.reward)
            total += weight * score.reward
            applied += 1
        if failures:
            details["failure_kind"] = "scorer"
            combined.append(
                Score(reward=None, parsed_answer=parsed, details=details, failure="; ".join(failures))
            )
        elif applied == 0:
            details["failure_kind"] = "no_reward"
            combined.append(
                Score(
                    reward=None, parsed_answer=parsed, details=details, failure="no reward function applied"
                )
            )
        else:
            combined.append(Score(reward=total, parsed_answer=parsed, details=details))
    return combined


class RewardFunctionEnvironment(Environment):
    """Prompts from `source`; reward = Σ weight·f(...) over TRL-style functions (+ its own reward)."""

    def __init__(
        self,
        source: Environment,
        funcs: Sequence[RewardFunc],
        weights: Sequence[float] | None = None,
        source_weight: float = 0.0,
    ) -> None:
        weights = [1.0] * len(funcs) if weights is None else list(weights)
        if len(weights) != len(funcs):
            raise ValueError(f"{len(weights)} reward weights for {len(funcs)} reward functions")
        if not funcs and source_weight == 0.0:
            raise ValueError("nothing to score with: no reward functions and source_weight = 0")
        super().__init__(source.options)
        self.source = source
        self.funcs = list(funcs)
        self.weights = [float(w) for w in weights]
        self.source_weight = float(source_weight)
        self.name = source.name  # type: ignore[misc]  # the composite keeps its source's name
        self.description = source.description  # type: ignore[misc]
        self.success_threshold = self._threshold()  # type: ignore[misc]
        self.reward_range = self._range()  # type: ignore[misc]
        self._tagged = any(func_name(f) in ("answer_tags", "think_answer") for f in self.funcs)

    def _threshold(self) -> float:
        """Solved = the source's threshold met and every built-in format reward at its maximum."""
        threshold = self.source_weight * self.source.success_threshold if self.source_weight else 0.0
        for func, weight in zip(self.funcs, self.weights, strict=True):
            if func_name(func) in _BUILTIN_RANGES and weight > 0:
                threshold += weight * _BUILTIN_RANGES[func_name(func)][1]
        return threshold if threshold > 0 else 1.0

    def _range(self) -> tuple[float, float]:
        low = high = 0.0
        terms = [(self.source_weight, self.source.reward_range)] if self.source_weight else []
        for func, weight in zip(self.funcs, self.weights, strict=True):
            terms.append((weight, _BUILTIN_RANGES.get(func_name(func), (-math.inf, math.inf))))
        for weight, (lo, hi) in terms:
            a, b = weight * lo if weight else 0.0, weight * hi if weight else 0.0
            low, high = low + min(a, b), high + max(a, b)
        return low, high

    # Prompt source: delegate to the source environment.
    async def setup(self) -> None:
        await self.source.setup()

    def setup_scorer(self) -> None:
        if self.source_weight:
            self.source.setup_scorer()

    def options_dict(self) -> dict[str, Any]:
        return {
            **self.source.options_dict(),
            "reward_funcs": [func_name(f) for f in self.funcs],
            "reward_weights": self.weights,
            "env_reward_weight": self.source_weight,
        }

    def split_size(self, split: SplitName) -> int:
        return self.source.split_size(split)

    async def sample(self, n: int, split: SplitName = "train", start: int | None = None) -> list[PromptItem]:
        return await self.source.sample(n, split, start)

    def position(self, split: SplitName) -> int:
        return self.source.position(split)

    def state(self) -> dict[str, int]:
        return self.source.state()

    def load_state(self, state: dict[str, int]) -> None:
        self.source.load_state(state)

    async def score(self, prompt: PromptItem, completions: Sequence[str]) -> list[Score | float | None]:
        n = len(completions)
        parts: list[tuple[str, float, list[Score]]] = []
        if self.source_weight:
            # With an answer-in-tags format reward, the source scores the last <answer> block's content.
            answers = [extract_answer_tag(c) or c for c in completions] if self._tagged else list(completions)
            own = [as_score(s) for s in await self.source.score(prompt, answers)]
            if len(own) != n:
                raise ValueError(f"{self.source.name} scorer returned {len(own)} scores for {n} completions")
            parts.append((self.source.name, self.source_weight, own))
        for func, weight in zip(self.funcs, self.weights, strict=True):
            values = call_reward_func(func, prompt, completions)
            scores = [Score(reward=None) if v is None else as_score(v) for v in values]
            parts.append((func_name(func), weight, scores))
        return list(combine(parts, n))

    def evaluate(self, results: list[GroupResult]) -> dict[str, float]:
        return self.source.evaluate(results)

    def reference_completion(self, prompt: PromptItem) -> str:
        reference = self.source.reference_completion(prompt)
        names = {func_name(f) for f in self.funcs}
        if "<answer>" in reference:  # the source already answers in tags
            if "think_answer" not in names:
                return reference
            reference = extract_answer_tag(reference) or reference
        if "think_answer" in names:
            return f"<think>Working it out.</think>\n<answer>{reference}</answer>"
        if "answer_tags" in names:
            return f"<answer>{reference}</answer>"
        return reference

    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        return self.source.wrong_answers(prompt)
