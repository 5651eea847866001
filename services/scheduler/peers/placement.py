"""Pure rollout placement: which rollout takes the next group (the least loaded one that is fresh
enough for the version the group will be trained at, `pipeline/policy.expected_train_version`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar


class Candidate(Protocol):
    """What the dispatcher reads of a rollout (a `RolloutSlot`, or the pool's live handle)."""

    @property
    def name(self) -> str: ...

    @property
    def usable(self) -> bool: ...  # healthy and free for new work (not in a sync, not waiting for one)

    @property
    def in_flight(self) -> int: ...

    @property
    def max_in_flight(self) -> int: ...

    @property
    def version(self) -> int: ...


CandidateT = TypeVar("CandidateT", bound=Candidate)


@dataclass
class RolloutSlot:
    """What the dispatcher needs to know about one rollout."""

    rollout_id: str
    in_flight: int
    max_in_flight: int
    version: int
    healthy: bool

    @property
    def name(self) -> str:
        return self.rollout_id

    @property
    def usable(self) -> bool:
        return self.healthy


def credits_taken(candidate: Candidate, cost: int) -> int:
    """Credits a unit of work of `cost` requests takes on a rollout: all of its credits when it has
    fewer (it then runs the work's requests a few at a time)."""
    return max(1, min(cost, candidate.max_in_flight))


def choose_rollout(
    candidates: Iterable[CandidateT], train_version: int, max_staleness: int, cost: int = 1
) -> CandidateT | None:
    """The least-loaded usable rollout with `cost` free credits (`credits_taken`) whose weights are
    fresh enough for a group that will be trained at `train_version` (ties: fewer in flight, then by
    name); None if none qualifies now. One pass, no allocation per candidate: the dispatcher runs it
    for every group."""
    oldest = train_version - max_staleness
    best, best_key = None, None
    for c in candidates:
        in_flight, limit = c.in_flight, c.max_in_flight
        if in_flight + credits_taken(c, cost) <= limit and c.version >= oldest and c.usable:
            key = (in_flight / max(1, limit), in_flight, c.name)
            if best_key is None or key < best_key:
                best, best_key = c, key
    return best


def pick_rollout(slots: Sequence[RolloutSlot], train_version: int, max_staleness: int) -> str | None:
    """The id of `choose_rollout`'s pick among `slots`; None if no rollout qualifies now."""
    chosen = choose_rollout(slots, train_version, max_staleness)
    return None if chosen is None else chosen.rollout_id
