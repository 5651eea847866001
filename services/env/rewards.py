"""Plain reward functions (TRL's convention) and the scorer that adds them to an environment's reward.

A reward function is `f(prompts, completions, **columns) -> list[float | None]`, exactly like TRL's
`GRPOTrainer(reward_funcs=...)`: `prompts` and `completions` have one entry per completion (the prompt
repeated); for chat prompts a prompt is its message list and a completion is
`[{"role": "assistant", "content": text}]`, otherwise both are strings. `columns` holds the prompt's
metadata keys plus `reference_answer` (and `answer`, unless metadata has one), each repeated per
completion. `None` means "not applicable to this completion"; the weighted sum skips it, and a
completion no function applies to is a scoring failure.

`RewardFunctionScorer` scores an environment's prompts with weighted reward functions, optionally
keeping the environment's own reward as one more weighted term. It is a scorer only: the prompts
still come from the environment itself. When a built-in answer-in-tags format reward (`answer_tags`,
`think_answer`) is among the functions, the environment's scorer sees the content of the last
<answer>...</answer> block (the whole completion if there is none).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from services.env.base import Environment, PromptItem, Score, as_score

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
# Format rewards that ask for the answer in <answer> tags (the env then scores the tag content).
_TAG_FORMATS = frozenset({"answer_tags", "think_answer"})


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


class RewardFunctionScorer:
    """Scores `env`'s prompts with Σ weightᵢ·fᵢ(...) over TRL-style functions, plus env_weight·(env's reward).

    Satisfies `base.Scorer`: the scoring workers and `check` use it in place of the env's own scorer.
    """

    def __init__(
        self,
        env: Environment[Any],
        funcs: Sequence[RewardFunc],
        weights: Sequence[float] | None = None,
        env_weight: float = 0.0,
    ) -> None:
        weights = [1.0] * len(funcs) if weights is None else list(weights)
        if len(weights) != len(funcs):
            raise ValueError(f"{len(weights)} reward weights for {len(funcs)} reward functions")
        if not funcs and env_weight == 0.0:
            raise ValueError("nothing to score with: no reward functions and env_weight = 0")
        self.env = env
        self.funcs = list(funcs)
        self.weights = [float(w) for w in weights]
        self.env_weight = float(env_weight)
        self._names = {func_name(f) for f in self.funcs}
        self._tagged = bool(self._names & _TAG_FORMATS)
        self.success_threshold = self._threshold()
        self.reward_range = self._range()

    def _threshold(self) -> float:
        """Solved = the env's threshold met and every built-in format reward at its maximum."""
        threshold = self.env_weight * self.env.success_threshold if self.env_weight else 0.0
        for func, weight in zip(self.funcs, self.weights, strict=True):
            if func_name(func) in _BUILTIN_RANGES and weight > 0:
                threshold += weight * _BUILTIN_RANGES[func_name(func)][1]
        return threshold if threshold > 0 else 1.0

    def _range(self) -> tuple[float, float]:
        """The interval the weighted sum can reach (unbounded for user functions, whose range is unknown)."""
        low = high = 0.0
        terms = [(self.env_weight, self.env.reward_range)] if self.env_weight else []
        for func, weight in zip(self.funcs, self.weights, strict=True):
            terms.append((weight, _BUILTIN_RANGES.get(func_name(func), (-math.inf, math.inf))))
        for weight, (lo, hi) in terms:
            a, b = weight * lo if weight else 0.0, weight * hi if weight else 0.0
            low, high = low + min(a, b), high + max(a, b)
        return low, high

    def setup_scorer(self) -> None:
        if self.env_weight:
            self.env.setup_scorer()

    def options_dict(self) -> dict[str, Any]:
        return {
            **self.env.options_dict(),
            "reward_funcs": [func_name(f) for f in self.funcs],
            "reward_weights": self.weights,
            "env_reward_weight": self.env_weight,
        }

    async def score(self, prompt: PromptItem, completions: Sequence[str]) -> list[Score | float | None]:
        n = len(completions)
        parts: list[tuple[str, float, list[Score]]] = []
        if self.env_weight:
            # With an answer-in-tags format reward, the env scores the last <answer> block's content.
            answers = [extract_answer_tag(c) or c for c in completions] if self._tagged else list(completions)
            own = [as_score(s) for s in await self.env.score(prompt, answers)]
            if len(own) != n:
                raise ValueError(f"{self.env.name} scorer returned {len(own)} scores for {n} completions")
            parts.append((self.env.name, self.env_weight, own))
        for func, weight in zip(self.funcs, self.weights, strict=True):
            values = call_reward_func(func, prompt, completions)
            scores = [Score(reward=None) if v is None else as_score(v) for v in values]
            parts.append((func_name(func), weight, scores))
        return list(combine(parts, n))

    def reference_completion(self, prompt: PromptItem) -> str:
        """The env's reference, wrapped in the tags the format rewards ask for."""
        reference = self.env.reference_completion(prompt)
        if "<answer>" in reference:  # the env already answers in tags
            if "think_answer" not in self._names:
                return reference
            reference = extract_answer_tag(reference) or reference
        if "think_answer" in self._names:
            return f"<think>Working it out.</think>\n<answer>{reference}</answer>"
        if "answer_tags" in self._names:
            return f"<answer>{reference}</answer>"
        return reference

    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        return self.env.wrong_answers(prompt)
