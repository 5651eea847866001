"""Pure scheduling policy: staleness, admission, rollout choice, batch assembly."""

from __future__ import annotations

import pytest

from grpo.common.v1 import types_pb2
from services.scheduler.clients import ScoredGroup
from services.scheduler.policy import (
    RolloutSlot,
    build_train_batch,
    expected_train_version,
    group_staleness,
    oldest_version,
    pick_rollout,
)


def _completion(*spans: tuple[int, int, int]) -> types_pb2.Completion:
    c = types_pb2.Completion()
    for version, start, end in spans:
        c.version_spans.add(version=version, start=start, end=end)
    return c


def test_staleness_uses_the_oldest_token_of_the_group() -> None:
    group = [_completion((4, 0, 3), (5, 3, 6)), _completion((5, 0, 2))]
    assert oldest_version(group) == 4
    assert group_staleness(group, train_version=6) == 2
    with pytest.raises(ValueError, match="no weight-version spans"):
        oldest_version([types_pb2.Completion()])


@pytest.mark.parametrize(
    ("learner_version", "in_pipeline", "batch", "expected"),
    [(0, 0, 4, 0), (0, 3, 4, 0), (0, 4, 4, 1), (5, 9, 4, 7), (2, 31, 16, 3)],
)
def test_expected_train_version(learner_version: int, in_pipeline: int, batch: int, expected: int) -> None:
    assert expected_train_version(learner_version, in_pipeline, batch) == expected


def test_admission_holds_back_groups_a_lagging_rollout_would_make_stale() -> None:
    """B=4, max_staleness=1, learner at v1 with 4 groups queued: the next group trains at v2, so a rollout
    still on v0 (mid-sync) must not get it, while one on v1 may."""
    train_at = expected_train_version(learner_version=1, in_pipeline=4, groups_per_batch=4)
    lagging = [RolloutSlot("old", 0, 4, version=0, healthy=True)]
    assert pick_rollout(lagging, train_at, max_staleness=1) is None
    assert pick_rollout([*lagging, RolloutSlot("new", 2, 4, 1, True)], train_at, max_staleness=1) == "new"


def test_pick_rollout_least_loaded_fresh_and_healthy() -> None:
    slots = [
        RolloutSlot("a", in_flight=3, max_in_flight=4, version=5, healthy=True),
        RolloutSlot("b", in_flight=1, max_in_flight=4, version=5, healthy=True),
        RolloutSlot("c", in_flight=0, max_in_flight=4, version=5, healthy=False),  # unhealthy
        RolloutSlot("d", in_flight=0, max_in_flight=4, version=2, healthy=True),  # too stale
    ]
    assert pick_rollout(slots, train_version=5, max_staleness=1) == "b"
    assert pick_rollout(slots, train_version=5, max_staleness=3) == "d"
    full = [RolloutSlot("a", 4, 4, 5, True)]
    assert pick_rollout(full, 5, 1) is None


def test_build_train_batch_computes_advantages_over_the_batch() -> None:
    groups = [
        ScoredGroup("g0", types_pb2.Prompt(id="p0"), [], rewards=[1.0, 0.0, 1.0, 0.0]),
        ScoredGroup("g1", types_pb2.Prompt(id="p1"), [], rewards=[1.0, 1.0, 1.0, 1.0]),
    ]
    batch = build_train_batch(groups, step=7, batch_id="b7", advantage_mode="group_std")
    assert (batch.step, batch.batch_id, batch.groups) == (7, "b7", groups)
    assert batch.advantages[0] == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
    assert batch.advantages[1] == [0.0, 0.0, 0.0, 0.0]  # zero variance: no signal, no blow-up
    dr = build_train_batch(groups, step=0, batch_id="b", advantage_mode="group_mean")
    assert dr.advantages[0] == pytest.approx([0.5, -0.5, 0.5, -0.5])
