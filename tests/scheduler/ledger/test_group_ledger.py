"""GroupLedger: checked transitions, counts, re-issue attempts and the event sink."""

from __future__ import annotations

import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.scheduler.ledger.group_ledger import GroupLedger, GroupState


def test_full_lifecycle_and_counts() -> None:
    events = []
    ledger = GroupLedger(sink=lambda record: events.append(record.state))
    record = ledger.issue("p1", version=3)
    assert (record.group_id, record.attempt, record.issued_version) == ("p1#0", 0, 3)
    assert ledger.in_pipeline() == 1
    for state in (GroupState.GENERATED, GroupState.SCORED, GroupState.TRAINED):
        ledger.advance(record.group_id, state)
    assert ledger.counts() == {
        "issued": 0,
        "generated": 0,
        "scored": 0,
        "trained": 1,
        "dropped": 0,
        "filtered": 0,
    }
    assert ledger.in_pipeline() == 0
    assert events == ["issued", "generated", "scored", "trained"]


def test_illegal_transitions_are_refused() -> None:
    ledger = GroupLedger()
    gid = ledger.issue("p", 0).group_id
    with pytest.raises(FailedPrecondition, match="cannot go from issued to trained"):
        ledger.advance(gid, GroupState.TRAINED)
    ledger.advance(gid, GroupState.DROPPED, "rollout died")
    with pytest.raises(FailedPrecondition):
        ledger.advance(gid, GroupState.GENERATED)  # terminal: a dropped group never comes back
    assert ledger.get(gid).reason == "rollout died"
    with pytest.raises(NotFound):
        ledger.get("nope#0")


def test_reissue_gets_a_new_group_id() -> None:
    ledger = GroupLedger()
    first = ledger.issue("p", 0)
    ledger.advance(first.group_id, GroupState.DROPPED)
    second = ledger.issue("p", 1)
    assert second.group_id == "p#1" and second.attempt == 1
    assert ledger.counts()["dropped"] == 1 and ledger.in_pipeline() == 1
    assert sum(ledger.counts().values()) == len(ledger.records()) == 2
