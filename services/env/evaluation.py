"""Eval metrics from scored eval groups: mean reward, accuracy, pass@k, failure rate.

Pure functions. A completion is *solved* when its reward >= the environment's success threshold.
Failed scores (reward None) count as unsolved and are excluded from the mean reward.
pass@k uses the unbiased estimator of Chen et al. (2021): with n samples of which c are solved,
pass@k = 1 - C(n - c, k) / C(n, k), averaged over prompts that have at least k completions.
"""

from __future__ import annotations

import math

from services.env.base import GroupResult


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples (drawn without replacement from n) is solved."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to n, plus n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    ks.append(n)
    return ks


def eval_metrics(results: list[GroupResult], success_threshold: float) -> dict[str, float]:
    """The standard eval metrics (keys without the "eval/" prefix)."""
    rewards: list[float] = []
    solved_flags: list[bool] = []
    failures = 0
    per_group: list[tuple[int, int]] = []
    for group in results:
        solved = 0
        for score in group.scores:
            reward = None if score.failure else score.reward
            if reward is None:
                failures += 1
            else:
                rewards.append(float(reward))
            hit = reward is not None and float(reward) >= success_threshold
            solved += hit
            solved_flags.append(hit)
        per_group.append((len(group.scores), solved))
    total = len(solved_flags)
    metrics: dict[str, float] = {
        "num_prompts": float(len(results)),
        "num_completions": float(total),
        "failure_rate": failures / total if total else 0.0,
        "mean_reward": sum(rewards) / len(rewards) if rewards else 0.0,
        "accuracy": sum(solved_flags) / total if total else 0.0,
    }
    max_n = min((n for n, _ in per_group if n > 0), default=0)
    for k in k_values(max_n) if max_n > 1 else []:
        values = [pass_at_k(n, c, k) for n, c in per_group if n >= k]
        metrics[f"pass@{k}"] = sum(values) / len(values)
    return metrics
