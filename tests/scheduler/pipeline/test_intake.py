"""source = external: SubmitGroups' groups into the ledger and the trainer's bounded queue (intake.py),
through the orchestrator against in-memory peers (tests/scheduler/fakes.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from grpo.common.v1 import types_pb2
from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.scheduler.config import SchedulerSettings
from services.scheduler.ledger.audit import audit
from services.scheduler.ledger.group_ledger import GroupState
from services.scheduler.ledger.store import read_ledger
from services.scheduler.orchestrator import Orchestrator
from services.scheduler.peers.rollouts import RolloutPool
from services.scheduler.pipeline.intake import ACCEPTED, DUPLICATE, STALE

from ..fakes import FakeLearner, FakeRollout


def _settings(run_dir: Path, **overrides) -> SchedulerSettings:
    base = dict(
        source="external", group_size=2, groups_per_batch=2, max_steps=3, max_staleness=1, run_dir=run_dir,
        health_interval_seconds=0.01, weight_transport="shared_memory", rollout_addresses=[],
        recovery={"retry_interval": 0.01, "retry_max_interval": 0.05, "ledger_flush_interval": 0.01},
    )  # fmt: skip
    return SchedulerSettings(**{**base, **overrides})


def _orchestrator(run_dir: Path, learner: FakeLearner, rollout: FakeRollout, **overrides) -> Orchestrator:
    pool = RolloutPool(lambda address: rollout)
    pool.add(rollout.address)
    return Orchestrator(_settings(run_dir, **overrides), None, learner, pool)


def group(gid: str, version: int, rewards=(1.0, 0.0), n: int = 2) -> types_pb2.ScoredGroup:
    """A matched group as the gateway sends it: prompt hoisted, each completion with its tokens,
    behaviour logprobs and version span (what the registry held)."""
    completions = [
        types_pb2.Completion(
            index=i, completion_token_ids=[5 + i, 6], logprobs=[-1.0, -1.0],
            version_spans=[types_pb2.WeightVersionSpan(version=version, start=0, end=2)],
            sampling_params=types_pb2.SamplingParams(temperature=1.0, top_p=1.0),
        )
        for i in range(n)
    ]  # fmt: skip
    return types_pb2.ScoredGroup(
        group_id=gid, completions=completions, rewards=list(rewards), prompt_token_ids=[1, 2, 3]
    )


async def _until(predicate, timeout: float = 5.0) -> None:  # noqa: ASYNC109
    async with asyncio.timeout(timeout):
        while not predicate():  # noqa: ASYNC110 (a condition of several objects)
            await asyncio.sleep(0.005)


async def test_external_groups_train_once_and_the_ledger_keeps_them_across_a_restart(tmp_path: Path) -> None:
    learner, rollout = FakeLearner(), FakeRollout("r0")
    orch = _orchestrator(tmp_path, learner, rollout)
    run = asyncio.create_task(orch.run())
    await _until(lambda: orch.intake._open.is_set())
    verdicts = await orch.intake.submit([group("ext-a", 0), group("ext-b", 0)], "atropos:test")
    assert [v.kind for v in verdicts] == [ACCEPTED, ACCEPTED]
    # a retried submission is acknowledged, never queued twice
    again = await orch.intake.submit([group("ext-a", 0)], "atropos:test")
    assert [v.kind for v in again] == [DUPLICATE] and "ext-a#0" in again[0].reason
    await _until(lambda: orch.step == 1)
    # staleness: at version 1 (max_staleness 1) version 0 is fine, then the learner moves on
    await orch.intake.submit([group("ext-c", 1), group("ext-d", 1)], "atropos:test")
    await _until(lambda: orch.step == 2)
    stale = await orch.intake.submit([group("ext-old", 0)], "atropos:test")
    assert stale[0].kind == STALE and "stale by 2 versions" in stale[0].reason
    assert (await orch.intake.submit([group("ext-old", 0)], "atropos:test"))[0].kind == STALE
    await orch.intake.submit([group("ext-e", 2), group("ext-f", 2)], "atropos:test")
    await asyncio.wait_for(run, 10)
    assert orch.finished and not orch.error
    assert [b.step for b in learner.batches] == [0, 1, 2]
    trained = sorted(r.prompt_id for r in orch.ledger.records() if r.state == GroupState.TRAINED)
    assert trained == ["ext-a", "ext-b", "ext-c", "ext-d", "ext-e", "ext-f"]
    snapshot = read_ledger(tmp_path)
    report = audit(snapshot)
    assert report.ok, report.violations
    assert report.summary["groups_dropped"] == 1 and report.summary["positions"] == 7

    # a restarted scheduler on the same ledger still knows every submission id
    orch2 = _orchestrator(tmp_path, learner, rollout, max_steps=4)
    run2 = asyncio.create_task(orch2.run())
    await _until(lambda: orch2.intake._open.is_set())
    assert (await orch2.intake.submit([group("ext-f", 2)], "atropos:test"))[0].kind == DUPLICATE
    run2.cancel()
    await asyncio.gather(run2, return_exceptions=True)


async def test_a_full_queue_takes_nothing_and_bad_groups_are_refused(tmp_path: Path) -> None:
    learner, rollout = FakeLearner(), FakeRollout("r0")
    orch = _orchestrator(tmp_path, learner, rollout, max_steps=1, groups_per_batch=4)
    run = asyncio.create_task(orch.run())
    await _until(lambda: orch.intake._open.is_set())
    # capacity (max_staleness + 1) × B = 8; the trainer waits for the probe's group, then B = 4
    assert orch.intake.capacity == 8
    with pytest.raises(InvalidArgument, match="3 completions; this run's group size is 2"):
        await orch.intake.submit([group("ext-x", 0, rewards=(1.0, 0.0, 1.0), n=3)], "t")
    with pytest.raises(InvalidArgument, match="newer than the learner"):
        await orch.intake.submit([group("ext-future", 5)], "t")
    await orch.intake.submit([group(f"ext-{i}", 0) for i in range(8)], "t")
    waiting = orch.intake.waiting  # the trainer may have taken some since: the rest wait
    with pytest.raises(ResourceExhausted, match="no room"):
        await orch.intake.submit([group(f"ext-more-{i}", 0) for i in range(9 - waiting)], "t")
    assert orch.intake.waiting == waiting  # all or nothing
    assert orch.ledger.latest("ext-more-0") is None
    await asyncio.wait_for(run, 10)
    assert orch.finished and not orch.error
    with pytest.raises(FailedPrecondition, match="the run is over"):
        await orch.intake.submit([group("ext-late", 1)], "t")


async def test_a_scheduler_of_its_own_env_has_no_intake_open(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eval_every needs the env service"):
        _settings(tmp_path, eval_every=5)


async def test_a_submission_being_written_when_the_run_stops_is_written_first(tmp_path: Path) -> None:
    learner, rollout = FakeLearner(), FakeRollout("r0")
    orch = _orchestrator(tmp_path, learner, rollout, max_steps=5)
    run = asyncio.create_task(orch.run())
    await _until(lambda: orch.intake._open.is_set())
    submitting = asyncio.create_task(orch.intake.submit([group("ext-last", 0)], "t"))
    await asyncio.sleep(0)  # it holds the intake and waits on the ledger's write
    run.cancel()  # the run stops (SIGTERM): its ledger closes
    await asyncio.gather(run, return_exceptions=True)
    verdicts = await submitting  # answered: written before the ledger closed, never a closed-ledger error
    assert [v.kind for v in verdicts] == [ACCEPTED]
    assert any(r.prompt_id == "ext-last" for r in read_ledger(tmp_path).groups)
    with pytest.raises(FailedPrecondition, match="the run is over"):
        await orch.intake.submit([group("ext-after", 0)], "t")
