"""Pure scheduling policy: staleness, admission control, rollout choice, batch assembly.

Staleness of a group = the learner version it is trained at minus the oldest weight version that
produced any of its tokens. Admission control keeps it bounded *before* generation (AReaL-style):
with B groups per step and `in_pipeline` groups already issued but not trained, a new group will be
trained at learner version `learner_version + in_pipeline // B`; it may only be issued to a rollout
whose weights are at most `max_staleness` versions older than that. Groups that still exceed the
bound at batch time (e.g. a slow rollout finished out of order) are dropped and their prompt
re-issued, never silently trained.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from grpo.common.v1 import types_pb2
from services.common.advantages import compute_advantages
from services.scheduler.clients import Batch, ScoredGroup


def span_versions(completions: Iterable[types_pb2.Completion]) -> set[int]:
    """Every weight version that produced a token of these completions."""
    versions = {span.version for c in completions for span in c.version_spans}
    if not versions:
        raise ValueError("completions carry no weight-version spans")
    return versions


def oldest_version(completions: Sequence[types_pb2.Completion]) -> int:
    """Oldest weight version that produced any token of these completions."""
    return min(span_versions(completions))


def group_staleness(completions: Sequence[types_pb2.Completion], train_version: int) -> int:
    return train_version - oldest_version(completions)


def expected_train_version(learner_version: int, in_pipeline: int, groups_per_batch: int) -> int:
    """The learner version at which a group issued now will be trained (groups train in issue order)."""
    return learner_version + in_pipeline // groups_per_batch


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


def choose_rollout(
    candidates: Iterable[CandidateT], train_version: int, max_staleness: int
) -> CandidateT | None:
    """The least-loaded usable rollout with a free credit whose weights are fresh enough for a group
    that will be trained at `train_version` (ties: fewer in flight, then by name); None if none
    qualifies now. One pass, no allocation per candidate: the dispatcher runs it for every group."""
    oldest = train_version - max_staleness
    best, best_key = None, None
    for c in candidates:
        in_flight, limit = c.in_flight, c.max_in_flight
        if in_flight < limit and c.version >= oldest and c.usable:
            key = (in_flight / max(1, limit), in_flight, c.name)
            if best_key is None or key < best_key:
                best, best_key = c, key
    return best


def pick_rollout(slots: Sequence[RolloutSlot], train_version: int, max_staleness: int) -> str | None:
    """The id of `choose_rollout`'s pick among `slots`; None if no rollout qualifies now."""
    chosen = choose_rollout(slots, train_version, max_staleness)
    return None if chosen is None else chosen.rollout_id


def build_train_batch(groups: Sequence[ScoredGroup], step: int, batch_id: str, advantage_mode: str) -> Batch:
    """The batch of one optimizer step: `groups` with their advantages (mode over the whole batch)."""
    advantages = compute_advantages([g.rewards for g in groups], advantage_mode)
    return Batch(batch_id=batch_id, step=step, groups=list(groups), advantages=advantages)
