"""BatchAssembler: replayed batches first, then requeued groups, then the pipeline's; too-stale groups
and groups of a lost learner lineage are dropped and their prompts issued again; a new batch is on disk
before it is returned."""

from __future__ import annotations

from pathlib import Path

from grpo.common.v1 import types_pb2
from services.scheduler.ledger.group_ledger import GroupState
from services.scheduler.ledger.recovery import LOST_LINEAGE, RecoveryPlan
from services.scheduler.ledger.store import BatchRow, read_ledger
from services.scheduler.peers.clients import LearnerInfo, ScoredGroup
from services.scheduler.pipeline.batches import BatchAssembler
from tests.scheduler.fakes import Cluster, cluster


def _scored(c: Cluster, prompt_id: str, position: int, *versions: int, rewards=(1.0, 0.0)) -> ScoredGroup:
    """A group issued, generated and scored at `versions`, as the pipeline would leave it."""
    orch = c.orchestrator
    record = orch.ledger.issue(prompt_id, min(versions), position, orch.lineage.generation)
    orch.ledger.advance(record.group_id, GroupState.GENERATED, versions=versions)
    orch.ledger.advance(record.group_id, GroupState.SCORED)
    completions = [types_pb2.Completion(index=i, completion_token_ids=[7]) for i in range(len(rewards))]
    for completion in completions:  # one token per version: the ledger reads versions back from spans
        for offset, version in enumerate(versions):
            completion.version_spans.add(version=version, start=offset, end=offset + 1)
    prompt = types_pb2.Prompt(id=prompt_id)
    group = ScoredGroup(record.group_id, prompt, completions, list(rewards), versions=frozenset(versions))
    orch.store.scored(group)
    return group


async def _opened(tmp_path: Path, **settings) -> tuple[Cluster, BatchAssembler]:
    c = cluster(tmp_path, groups_per_batch=2, max_staleness=1, **settings)
    await c.orchestrator.store.open()
    return c, c.orchestrator.batches


async def test_a_new_batch_takes_fresh_groups_drops_stale_ones_and_is_on_disk_first(tmp_path: Path) -> None:
    c, batches = await _opened(tmp_path)
    old, fresh_a, fresh_b = _scored(c, "p0", 0, 1), _scored(c, "p1", 1, 2, 3), _scored(c, "p2", 2, 3)
    for group in (old, fresh_a, fresh_b):
        await c.orchestrator.groups.scored.put(group)
    planned = await batches.next(step=3, version=3)
    assert [g.group_id for g in planned.groups] == [fresh_a.group_id, fresh_b.group_id]
    assert planned.staleness == [1, 0] and not planned.retrained
    assert planned.row == BatchRow(3, "step-3", 3, (fresh_a.group_id, fresh_b.group_id))
    stale = c.orchestrator.ledger.get(old.group_id)
    assert (stale.state, stale.reason, stale.reissue) == (GroupState.DROPPED, "stale by 2 versions", True)
    assert [position for position, _ in c.orchestrator.groups.reissue] == [0]  # its prompt, same position
    assert read_ledger(tmp_path).batches[3] == planned.row  # committed before it was returned
    await c.orchestrator.store.close()


async def test_replayed_batches_then_requeued_groups_then_the_pipeline(tmp_path: Path) -> None:
    c, batches = await _opened(tmp_path)
    trained = [_scored(c, "p0", 0, 0), _scored(c, "p1", 1, 0)]
    replayed = BatchRow(0, "step-0", 0, tuple(g.group_id for g in trained))
    await c.orchestrator.store.commit_batch(replayed)
    requeued = _scored(c, "p2", 2, 0)
    piped = _scored(c, "p3", 3, 1)
    batches.replay([replayed])
    batches.requeue([requeued])
    await c.orchestrator.groups.scored.put(piped)
    assert batches.waiting == 1

    first = await batches.next(step=0, version=0)
    assert first.retrained and first.row == replayed
    assert [g.group_id for g in first.groups] == list(replayed.group_ids)  # read back from the ledger
    second = await batches.next(step=1, version=1)
    assert [g.group_id for g in second.groups] == [requeued.group_id, piped.group_id]
    assert second.staleness == [1, 0] and batches.waiting == 0

    batches.retry(second.row)  # the learner went away before acknowledging it: first again, same id
    again = await batches.next(step=1, version=1)
    assert again.retrained and again.row == second.row
    batches.trained(second.staleness)
    batches.trained([0, 0])
    assert batches.staleness_mean == 0.25
    await c.orchestrator.store.close()


async def test_a_group_of_a_lost_lineage_is_never_batched(tmp_path: Path) -> None:
    c, batches = await _opened(tmp_path)
    orch = c.orchestrator
    lost = _scored(c, "p0", 0, 4)  # generated at v4 in generation 0
    # the learner comes back at v2 from an older checkpoint: generation 1, versions above 2 are gone
    await orch.lineage.apply(RecoveryPlan(rewound_from=4), LearnerInfo(2, 2, "grpo"), orch.report.open())
    kept = [_scored(c, "p1", 1, 2), _scored(c, "p2", 2, 2)]  # issued in generation 1
    for group in (lost, *kept):
        await orch.groups.scored.put(group)
    planned = await batches.next(step=2, version=2)
    assert [g.group_id for g in planned.groups] == [g.group_id for g in kept]
    assert orch.ledger.get(lost.group_id).reason == LOST_LINEAGE
    orch.report.close()
    await orch.store.close()
