"""Group-relative advantages for GRPO-family training (pure Python, used by the scheduler).

Modes (one advantage per completion, groups = the G completions of one prompt):

    group_std   (R_i − mean_g) / std_g          GRPO (DeepSeekMath)
    group_mean  R_i − mean_g                     Dr.GRPO (no std: avoids the difficulty bias)
    batch_std   (R_i − mean_g) / std_batch       AReaL / ScaleRL: centred per group, scaled by the
                                                 std of all centred rewards in the batch

The std uses the population form (ddof = 0). The ε is *relative to the reward scale*
(scale = max |R| over the batch, at least 1): a group whose std is ≤ ε·scale is treated as
zero-variance and gets advantages of exactly 0 (never ±1 from float noise, never a blow-up:
atropos #457), and the denominator is std + ε·scale.
"""

from __future__ import annotations

import math
from enum import StrEnum

# Enum member names equal their values, so `--help` lists the values users type.


class LossKind(StrEnum):
    """The learner's objectives (services/learner/losses.py). Named here, in common, because the
    scheduler pairs each with an advantage mode and the launcher offers them as choices."""

    grpo = "grpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"
    gspo = "gspo"
    cispo = "cispo"


class AdvantageMode(StrEnum):
    group_std = "group_std"
    group_mean = "group_mean"
    batch_std = "batch_std"


ADVANTAGE_MODES = tuple(AdvantageMode)
# The advantage mode each loss is usually paired with (the scheduler's `advantage_mode=auto`).
MODE_FOR_LOSS: dict[LossKind, AdvantageMode] = {
    LossKind.grpo: AdvantageMode.group_std,
    LossKind.dr_grpo: AdvantageMode.group_mean,
    LossKind.dapo: AdvantageMode.group_std,
    LossKind.gspo: AdvantageMode.group_std,
    LossKind.cispo: AdvantageMode.group_std,
}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def compute_advantages(
    rewards: list[list[float]], mode: str = "group_std", eps: float = 1e-6
) -> list[list[float]]:
    """Advantages with the same nesting as `rewards` (one inner list per group).

    Raises ValueError for an unknown mode, a negative eps or a non-finite reward.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; choose one of {', '.join(ADVANTAGE_MODES)}")
    if eps < 0:
        raise ValueError("eps must be >= 0")
    flat = [r for group in rewards for r in group]
    if any(not math.isfinite(r) for r in flat):
        raise ValueError("rewards must be finite")
    if not flat:
        return [[] for _ in rewards]
    threshold = eps * max(1.0, max(abs(r) for r in flat))

    centred: list[list[float]] = []
    for group in rewards:
        if not group or _std(group) <= threshold:
            centred.append([0.0] * len(group))
        else:
            mean = _mean(group)
            centred.append([r - mean for r in group])

    if mode == "group_mean":
        return centred
    if mode == "group_std":
        out = []
        for group, cgroup in zip(rewards, centred, strict=True):
            if all(c == 0.0 for c in cgroup):
                out.append(cgroup)
            else:
                std = _std(group)
                out.append([c / (std + threshold) for c in cgroup])
        return out
    # batch_std
    batch_std = _std([c for cgroup in centred for c in cgroup])
    if batch_std <= threshold:
        return [[0.0] * len(group) for group in centred]
    return [[c / (batch_std + threshold) for c in cgroup] for cgroup in centred]
