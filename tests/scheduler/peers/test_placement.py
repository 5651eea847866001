"""Pure rollout placement: fresh enough for the group's train version, least loaded, usable."""

from __future__ import annotations

from services.scheduler.peers.placement import RolloutSlot, pick_rollout
from services.scheduler.pipeline.policy import expected_train_version


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
