"""Eval metrics: pass@k (unbiased estimator) and accuracy / mean reward / failure rate, by hand."""

from __future__ import annotations

import pytest

from services.env.base import GroupResult, PromptItem, Score
from services.env.evaluation import eval_metrics, k_values, pass_at_k


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (4, 1, 1, 0.25),
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (4, 1, 4, 1.0),
        (4, 0, 4, 0.0),
        (1, 1, 1, 1.0),
    ],
)
def test_pass_at_k(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_k_values() -> None:
    assert k_values(1) == [1]
    assert k_values(4) == [1, 2, 4]
    assert k_values(6) == [1, 2, 4, 6]


def group(*rewards: float | None) -> GroupResult:
    scores = [Score(r) if r is not None else Score(None, failure="timeout: x") for r in rewards]
    return GroupResult(PromptItem(id="p", text="q"), ["c"] * len(rewards), scores)


def test_eval_metrics_by_hand() -> None:
    metrics = eval_metrics([group(1.0, 0.0, 0.0, 0.0), group(1.0, 1.0, 0.5, None)], success_threshold=1.0)
    assert metrics["num_prompts"] == 2 and metrics["num_completions"] == 8
    assert metrics["failure_rate"] == pytest.approx(1 / 8)
    assert metrics["mean_reward"] == pytest.approx(3.5 / 7)  # the failed score is excluded
    assert metrics["accuracy"] == pytest.approx(3 / 8)
    assert metrics["pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert metrics["pass@2"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert metrics["pass@4"] == pytest.approx(1.0)


def test_eval_metrics_single_sample_has_no_pass_at_k() -> None:
    metrics = eval_metrics([group(1.0), group(0.0)], success_threshold=1.0)
    assert metrics["accuracy"] == 0.5
    assert not any(key.startswith("pass@") for key in metrics)
