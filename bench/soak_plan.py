"""The soak's fault schedule (bench/soak.py): which service gets which fault when, drawn from a seed.

Services come in a shuffled round robin (every service once per round, each round in a new order), so
any `faults` ≥ the number of services covers them all. The first round freezes every service (a
frozen peer is what the soak is about: hung is not dead); each later fault is a `kill` (SIGKILL of
the service's process group) with probability `kill_fraction`, else a `freeze`. A freeze lasts a
duration drawn from `freeze`; the next fault starts a gap drawn from `interval` after the previous
one ends (a kill ends when it is sent), so faults never overlap and each stall has one cause.
Offsets are seconds after the run's first completed step. Pure: no processes, no clock.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

Kind = Literal["kill", "freeze"]


def run_services(rollouts: int) -> list[str]:
    """The launcher's tags for the services of a demo with `rollouts` rollouts (its log and port names)."""
    return ["env", "learner", "scheduler", *(f"rollout-{i}" for i in range(rollouts))]


@dataclass(frozen=True)
class PlannedFault:
    at: float  # seconds after the first completed step
    service: str  # a launcher tag: env, learner, scheduler, rollout-<i>
    kind: Kind
    freeze_s: float  # 0 for a kill

    @property
    def end(self) -> float:
        return self.at + self.freeze_s

    def as_dict(self) -> dict:
        return asdict(self)


def plan_faults(
    services: Sequence[str],
    faults: int,
    seed: int,
    interval: tuple[float, float],
    freeze: tuple[float, float],
    kill_fraction: float,
) -> list[PlannedFault]:
    """`faults` faults over `services` (see the module docstring); the same arguments give the same plan."""
    if not services:
        raise ValueError("no services to fault")
    for name, (low, high) in (("interval", interval), ("freeze", freeze)):
        if not 0 <= low <= high:
            raise ValueError(f"{name}: need 0 <= MIN <= MAX, got {low:g} {high:g}")
    if not 0.0 <= kill_fraction <= 1.0:
        raise ValueError(f"kill_fraction must be within [0, 1], got {kill_fraction:g}")
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < faults:
        round_ = list(services)
        rng.shuffle(round_)
        order += round_
    plan: list[PlannedFault] = []
    end = 0.0
    for i, service in enumerate(order[:faults]):
        at = end + rng.uniform(*interval)
        kind: Kind = "freeze" if i < len(services) or rng.random() >= kill_fraction else "kill"
        freeze_s = round(rng.uniform(*freeze), 1) if kind == "freeze" else 0.0
        fault = PlannedFault(round(at, 1), service, kind, freeze_s)
        plan.append(fault)
        end = fault.end
    return plan


def horizon(plan: Sequence[PlannedFault], duration: float, tail: float) -> float:
    """Seconds of training the run must last: the duration, or longer when the schedule needs it (its
    last fault's end plus `tail` seconds to recover and show that it did)."""
    return max(duration, (plan[-1].end if plan else 0.0) + tail)


def auto_steps(plan: Sequence[PlannedFault], duration: float, tail: float, steps_per_s: float) -> int:
    """Steps enough for `horizon()` seconds of training at `steps_per_s` (on top of every stall: the
    faults stall training, so the run lasts longer than the horizon, and every fault falls inside it
    unless training is faster than `steps_per_s`)."""
    return max(1, math.ceil(horizon(plan, duration, tail) * steps_per_s))
