"""Pure scheduling policy: staleness, admission control and the batch of a step (rollout choice:
`peers/placement.py`).

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

from grpo.common.v1 import types_pb2
from services.common.advantages import compute_advantages
from services.scheduler.peers.clients import Batch, ScoredGroup


def hoist_facts(
    completions: Sequence[types_pb2.Completion],
) -> tuple[list[int], types_pb2.SamplingParams, str]:
    """The group's prompt tokens, sampling parameters and rollout, taken from its first completion and
    cleared in every member: they travel once per group (to the ledger and the learner), not G times."""
    first = completions[0]
    facts = list(first.prompt_token_ids), types_pb2.SamplingParams(), first.rollout_id
    facts[1].CopyFrom(first.sampling_params)
    for c in completions:
        c.ClearField("prompt_token_ids")
        c.ClearField("sampling_params")
        c.ClearField("rollout_id")
    return facts


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


def build_train_batch(groups: Sequence[ScoredGroup], step: int, batch_id: str, advantage_mode: str) -> Batch:
    """The batch of one optimizer step: `groups` with their advantages (mode over the whole batch)."""
    advantages = compute_advantages([g.rewards for g in groups], advantage_mode)
    return Batch(batch_id=batch_id, step=step, groups=list(groups), advantages=advantages)
