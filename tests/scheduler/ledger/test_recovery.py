"""Recovery planning from a ledger snapshot (pure), and the SQLite store it reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.common.v1 import types_pb2
from services.scheduler.ledger.group_ledger import GroupLedger, GroupState
from services.scheduler.ledger.recovery import (
    IN_FLIGHT,
    LOST_LINEAGE,
    LedgerMismatch,
    check_restored,
    learner_ahead,
    ledger_steps,
    plan_recovery,
)
from services.scheduler.ledger.store import BatchRow, LedgerStore, Snapshot, TrainingRow, read_ledger
from services.scheduler.peers.clients import LearnerInfo, ScoredGroup


def _snapshot(groups, batches=(), trainings=(), scored=None) -> Snapshot:
    """groups: (prompt_id, position, state, versions[, reissue]) in issue order."""
    ledger = GroupLedger()
    for prompt_id, position, state, versions, *reissue in groups:
        record = ledger.issue(prompt_id, min(versions, default=0), position)
        path = {
            GroupState.ISSUED: [],
            GroupState.GENERATED: [GroupState.GENERATED],
            GroupState.SCORED: [GroupState.GENERATED, GroupState.SCORED],
            GroupState.TRAINED: [GroupState.GENERATED, GroupState.SCORED, GroupState.TRAINED],
            GroupState.DROPPED: [GroupState.DROPPED],
        }[state]
        for step in path:
            ledger.advance(record.group_id, step, versions=versions, reissue=bool(reissue and reissue[0]))
    records = ledger.records()
    ids = {r.group_id for r in records if r.state in (GroupState.SCORED, GroupState.TRAINED)}
    return Snapshot(
        meta={"max_staleness": "1", "groups_per_batch": "2"},
        groups=records,
        batches={b.step: b for b in batches},
        trainings=list(trainings),
        scored_ids=ids if scored is None else scored,
    )


def _info(step: int, last: str = "") -> LearnerInfo:
    return LearnerInfo(step, step, "grpo", last, "lineage", "instance")


def _row(step: int, *gids: str) -> BatchRow:
    return BatchRow(step, f"step-{step}", step, gids)


def _trained(step: int, generation: int = 0, row_id: int = 0) -> TrainingRow:
    return TrainingRow(row_id or step + 1, step, f"step-{step}", step + 1, "i", generation)


T, S, G, ISS, D = (
    GroupState.TRAINED,
    GroupState.SCORED,
    GroupState.GENERATED,
    GroupState.ISSUED,
    GroupState.DROPPED,
)


def test_after_a_scheduler_crash_the_unacknowledged_batch_is_sent_again_and_in_flight_prompts_reissued() -> (
    None
):
    snapshot = _snapshot(
        [
            ("a", 0, T, [0]),
            ("b", 1, T, [0]),
            ("c", 2, S, [1]),
            ("d", 3, S, [1]),
            ("e", 4, S, [1]),
            ("f", 5, G, [1]),
            ("g", 6, ISS, []),
        ],
        batches=[_row(0, "a#0", "b#0"), _row(1, "c#0", "d#0")],
        trainings=[_trained(0)],
    )
    plan = plan_recovery(snapshot, _info(1, "step-0"))  # the learner never saw step 1
    assert [b.step for b in plan.replay] == [1] and not plan.acknowledge and not plan.rewind
    assert plan.requeue == ["e#0"]  # scored, in no batch: batched without regenerating
    assert plan.drop == [("f#0", IN_FLIGHT), ("g#0", IN_FLIGHT)]
    assert plan.reissue == [5, 6] and plan.next_position == 7


def test_a_batch_the_learner_trained_but_nobody_acknowledged_is_acknowledged_not_retrained() -> None:
    snapshot = _snapshot(
        [("a", 0, S, [0]), ("b", 1, S, [0])],
        batches=[_row(0, "a#0", "b#0")],
    )
    plan = plan_recovery(snapshot, _info(1, "step-0"))
    assert [b.step for b in plan.acknowledge] == [0] and not plan.replay


def test_a_learner_behind_the_ledger_rewinds_and_lost_lineage_groups_are_regenerated() -> None:
    snapshot = _snapshot(
        [
            ("a", 0, T, [0]),
            ("b", 1, T, [0]),
            ("c", 2, T, [1]),
            ("d", 3, T, [1]),
            ("e", 4, S, [2]),
            ("f", 5, S, [1]),
        ],
        batches=[_row(0, "a#0", "b#0"), _row(1, "c#0", "d#0")],
        trainings=[_trained(0), _trained(1)],
    )
    plan = plan_recovery(snapshot, _info(1, "step-0"))  # restored from its step-1 checkpoint
    assert plan.rewound_from == 2
    assert [b.step for b in plan.replay] == [1]  # the same batch, trained again on the restored model
    assert plan.drop == [("e#0", LOST_LINEAGE)] and plan.requeue == ["f#0"]
    assert plan.reissue == [4]


def test_dropped_prompts_waiting_for_reissue_are_reissued_once_and_given_up_ones_not() -> None:
    snapshot = _snapshot(
        [("a", 0, D, [], True), ("b", 1, D, [], False), ("c", 2, D, [], True), ("c", 2, S, [0])]
    )
    plan = plan_recovery(snapshot, _info(0))
    assert plan.reissue == [0]  # b was given up; c's later attempt is alive
    assert plan.requeue == ["c#1"] and plan.next_position == 3


def test_a_prompt_whose_later_attempt_is_in_a_batch_is_not_reissued() -> None:
    """Found by the chaos run: a prompt dropped for re-issue whose next attempt was already batched
    (and trained) must not be issued a third time after a scheduler restart."""
    snapshot = _snapshot(
        [("a", 0, D, [], True), ("a", 0, T, [1]), ("b", 1, T, [1])],
        batches=[_row(1, "a#1", "b#0")],
        trainings=[_trained(1)],
    )
    plan = plan_recovery(snapshot, _info(2, "step-1"))
    assert not plan.reissue and not plan.drop and plan.next_position == 2


def test_a_learner_ahead_of_the_ledger_must_go_back_before_a_plan() -> None:
    """Power loss: the ledger lost its last writes, the learner's later checkpoint survived."""
    snapshot = _snapshot([("a", 0, T, [0]), ("b", 1, S, [1])], batches=[_row(0, "a#0")])
    assert ledger_steps(snapshot) == 1  # batch 0 is durable; a learner at step 1 trained it
    assert not learner_ahead(snapshot, _info(1, "step-0"))
    assert learner_ahead(snapshot, _info(5))
    with pytest.raises(LedgerMismatch, match="must go back"):
        plan_recovery(snapshot, _info(5))
    snapshot.meta["first_step"] = "3"  # a ledger started on a learner already at step 3
    assert ledger_steps(snapshot) == 3 and not learner_ahead(snapshot, _info(3))
    # a ledger that never recorded a step (no batch, no first_step) cannot tell
    assert not learner_ahead(_snapshot([("a", 0, S, [0])]), _info(5))


def test_a_learner_that_went_back_is_rewound_from_the_version_it_discarded() -> None:
    """Went back from step 5 (versions 2..5 exist nowhere in the ledger but rollouts may hold them) to
    its step-1 checkpoint: the rewind covers the discarded versions, step 1 is trained again, and a
    scored group with a token newer than version 1 is dropped."""
    snapshot = _snapshot(
        [("a", 0, T, [0]), ("b", 1, T, [1]), ("c", 2, S, [1]), ("d", 3, S, [2])],
        batches=[_row(0, "a#0"), _row(1, "b#0")],
        trainings=[_trained(0)],
    )
    assert ledger_steps(snapshot) == 2
    check_restored(snapshot, _info(1, "step-0"))
    plan = plan_recovery(snapshot, _info(1, "step-0"), discarded_version=5)
    assert plan.rewound_from == 5 and [b.step for b in plan.replay] == [1]
    assert plan.drop == [("d#0", LOST_LINEAGE)] and plan.requeue == ["c#0"] and plan.reissue == [3]
    # went back to exactly what the ledger knows: still a rewind (rollouts may hold versions 3..5)
    plan = plan_recovery(snapshot, _info(2, "step-1"), discarded_version=5)
    assert plan.rewound_from == 5 and not plan.replay and plan.acknowledge == [snapshot.batches[1]]


def test_a_learner_that_went_back_to_another_runs_batch_or_not_far_enough_is_refused() -> None:
    snapshot = _snapshot([("a", 0, T, [0]), ("b", 1, T, [1])], batches=[_row(0, "a#0"), _row(1, "b#0")])
    with pytest.raises(LedgerMismatch, match="not one run"):
        check_restored(snapshot, _info(1, "other-run-batch"))
    with pytest.raises(LedgerMismatch, match="still at step"):
        check_restored(snapshot, _info(4, "step-3"))
    snapshot.meta["first_step"] = "1"
    with pytest.raises(LedgerMismatch, match="before this ledger's first step"):
        check_restored(snapshot, _info(0))
    check_restored(snapshot, _info(2, "step-1"))


async def test_the_store_writes_in_batches_and_reads_back_everything(tmp_path: Path) -> None:
    store = LedgerStore(tmp_path)
    assert (await store.open()).empty
    ledger = GroupLedger(sink=store.group_changed)
    prompt = types_pb2.Prompt(id="a", text="1+1=")
    record = ledger.issue("a", 0, position=0)
    store.prompt_issued(0, prompt)
    ledger.advance(record.group_id, GroupState.GENERATED, versions=[0, 1])
    ledger.advance(record.group_id, GroupState.SCORED)
    completion = types_pb2.Completion(
        prompt_id="a", completion_token_ids=[3], version_spans=[types_pb2.WeightVersionSpan(version=1, end=1)]
    )
    store.scored(ScoredGroup("a#0", prompt, [completion], [0.1 + 0.2], [types_pb2.RewardInfo(ok=True)], {1}))
    store.set_meta(run_id="r", max_staleness=1)
    store.event("scheduler_start", step=0)
    await store.commit_batch(BatchRow(0, "step-0", 0, ("a#0",)))
    assert not store.dirty and store.flushes == 1
    ledger.advance(record.group_id, GroupState.TRAINED)
    store.trained(0, "step-0", 1, "inst", 0)
    await store.close()

    snapshot = read_ledger(tmp_path)
    assert snapshot.meta == {"run_id": "r", "max_staleness": "1"}
    [group] = snapshot.groups
    assert (group.group_id, group.state, group.versions, group.position) == ("a#0", T, (0, 1), 0)
    assert snapshot.batches[0].group_ids == ("a#0",) and snapshot.trainings[0].version_after == 1
    assert snapshot.events[0][0] == "scheduler_start"
    reopened = LedgerStore(tmp_path)
    await reopened.open()
    stored = (await reopened.load_scored(["a#0"]))["a#0"]
    assert stored.rewards == [0.1 + 0.2]  # float64 exactly: a re-trained batch gets the same advantages
    assert stored.versions == {1} and stored.completions[0].completion_token_ids == [3]
    assert (await reopened.load_prompts([0]))[0].text == "1+1="
    await reopened.close()
