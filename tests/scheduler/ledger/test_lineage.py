"""Lineage: the learner that trains the run, what a restarted one must do, and what a rewind takes back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.common.v1 import types_pb2
from services.scheduler.ledger.group_ledger import GroupState
from services.scheduler.ledger.recovery import LedgerMismatch, RecoveryPlan
from services.scheduler.ledger.store import BatchRow, read_ledger
from services.scheduler.peers.clients import LearnerInfo, ScoredGroup
from tests.scheduler.fakes import FakeRollout, cluster


def _learner(version: int, instance: str = "i0", lineage: str = "L") -> LearnerInfo:
    return LearnerInfo(version, version, "grpo", lineage_id=lineage, instance_id=instance)


async def test_the_same_learner_returning_costs_nothing_and_another_run_is_refused(tmp_path: Path) -> None:
    c = cluster(tmp_path)
    lineage = c.orchestrator.lineage
    await c.orchestrator.store.open()
    lineage.start(_learner(3))
    assert await lineage.returned(_learner(3)) is None  # the same process: nothing was lost
    with pytest.raises(LedgerMismatch, match="lineage X"):
        await lineage.returned(_learner(0, instance="i1", lineage="X"))
    plan = await lineage.returned(_learner(3, instance="i1"))  # restarted, same run
    assert plan is not None and plan.rewound_from is None
    assert await lineage.returned(_learner(3, instance="i1")) is None  # it is the run's learner now
    await c.orchestrator.store.close()


async def test_a_rewind_starts_a_generation_sends_rollouts_back_and_loses_newer_tokens(
    tmp_path: Path,
) -> None:
    c = cluster(tmp_path, FakeRollout("r0"), FakeRollout("r1"))
    orch = c.orchestrator
    await orch.store.open()
    metrics = orch.report.open()
    orch.lineage.start(_learner(5))
    before = orch.ledger.issue("p0", 4, 0, orch.lineage.generation)  # generation 0
    orch.ledger.advance(before.group_id, GroupState.GENERATED, versions=(4,))
    r0, r1 = orch.pool.handles()
    orch.pool.committed([r0], 5)
    orch.pool.committed([r1], 3)

    replay = [BatchRow(3, "step-3", 3, ()), BatchRow(4, "step-4", 4, ())]
    plan = RecoveryPlan(replay=replay, rewound_from=5)
    assert await orch.lineage.apply(plan, _learner(3, instance="i1"), metrics) == replay
    assert orch.lineage.generation == 1
    assert (r0.needs_sync, r1.needs_sync) == (True, False)  # only weights newer than v3 go back

    def group(versions: tuple[int, ...], generation: int) -> ScoredGroup:
        record = orch.ledger.issue(f"q{len(orch.ledger.records())}", min(versions), -1, generation)
        return ScoredGroup(record.group_id, types_pb2.Prompt(), [], [], versions=frozenset(versions))

    assert orch.lineage.lost(group((3, 4), generation=0))  # a token of v4, which the rewind took back
    assert not orch.lineage.lost(group((2, 3), generation=0))  # all of it still exists
    assert not orch.lineage.lost(group((4,), generation=1))  # v4 of the new lineage
    await orch.store.flush()
    orch.report.close()
    snapshot = read_ledger(tmp_path)
    assert snapshot.meta["generation"] == "1"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["event"] == "learner_rewind" and rows[-1]["rewound_from_version"] == 5
    await orch.store.close()


async def test_acknowledging_marks_the_groups_trained_under_the_current_learner(tmp_path: Path) -> None:
    c = cluster(tmp_path)
    orch = c.orchestrator
    await orch.store.open()
    orch.lineage.start(_learner(0, instance="i7"))
    record = orch.ledger.issue("p0", 0, 0)
    for state in (GroupState.GENERATED, GroupState.SCORED):
        orch.ledger.advance(record.group_id, state, versions=(0,) if state == GroupState.GENERATED else ())
    orch.lineage.acknowledge(BatchRow(0, "step-0", 0, (record.group_id,)), version_after=1)
    await orch.store.flush()
    assert orch.ledger.get(record.group_id).state == GroupState.TRAINED
    (training,) = read_ledger(tmp_path).trainings
    assert (training.step, training.version_after, training.learner_instance) == (0, 1, "i7")
    await orch.store.close()
