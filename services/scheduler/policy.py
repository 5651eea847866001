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

from collections.abc import Sequence
from dataclasses import dataclass

from grpo.common.v1 import types_pb2
from services.common.advantages import compute_advantages
from services.scheduler.clients import Batch, ScoredGroup


def oldest_version(completions: Sequence[types_pb2.Completion]) -> int:
    """Oldest weight version that produced any token of these completions."""
    versions = [span.version for c in completions for span in c.version_spans]
    if not versions:
        raise ValueError("completions carry no weight-version spans")
    return min(versions)


def group_staleness(completions: Sequence[types_pb2.Completion], train_version: int) -> int:
    return train_version - oldest_version(completions)


def expected_train_version(learner_version: int, in_pipeline: int, groups_per_batch: int) -> int:
    """The learner version at which a group issued now will be trained (groups train in issue order)."""
    return learner_version + in_pipeline // groups_per_batch


@dataclass
class RolloutSlot:
    """What the dispatcher needs to know about one rollout."""

    rollout_id: str
    in_flight: int
    max_in_flight: int
    version: int
    healthy: bool


def pick_rollout(slots: Sequence[RolloutSlot], train_version: int, max_staleness: int) -> str | None:
    """The least-loaded healthy rollout with a free credit whose weights are fresh enough for a group
    that will be trained at `train_version` (ties: by id); None if no rollout qualifies now."""
    eligible = [
        s
        for s in slots
        if s.healthy and s.in_flight < s.max_in_flight and train_version - s.version <= max_staleness
    ]
    if not eligible:
        return None
    return min(
        eligible, key=lambda s: (s.in_flight / max(1, s.max_in_flight), s.in_flight, s.rollout_id)
    ).rollout_id


def build_train_batch(groups: Sequence[ScoredGroup], step: int, batch_id: str, advantage_mode: str) -> Batch:
    """The batch of one optimizer step: `groups` with their advantages (mode over the whole batch)."""
    advantages = compute_advantages([g.rewards for g in groups], advantage_mode)
    return Batch(batch_id=batch_id, step=step, groups=list(groups), advantages=advantages)
