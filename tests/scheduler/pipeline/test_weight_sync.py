"""WeightSyncer against in-memory peers: the two phases, partial failures, release, the probe."""

from __future__ import annotations

import asyncio
import math

import pytest

from grpo.common.v1 import types_pb2
from services.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from services.scheduler.peers.rollouts import RolloutPool
from services.scheduler.pipeline.weight_sync import AlignmentError, WeightSyncer
from services.transports import TransportKind
from tests.scheduler.fakes import FakeLearner, FakeRollout

PROBE = types_pb2.TokenSequence(prompt_token_ids=[1], completion_token_ids=[2, 3], temperature=1.0)


async def _setup(*rollouts: FakeRollout) -> tuple[WeightSyncer, FakeLearner, RolloutPool]:
    learner = FakeLearner()
    by_address = {r.address: r for r in rollouts}
    pool = RolloutPool(lambda address: by_address[address])
    for rollout in rollouts:
        pool.add(rollout.address)
    await pool.refresh_all(0)
    return WeightSyncer(learner, pool, TransportKind.shared_memory), learner, pool


async def test_every_target_stages_then_commits_and_the_version_is_released() -> None:
    a, b = FakeRollout("a"), FakeRollout("b")
    syncer, learner, pool = await _setup(a, b)
    learner.version = 3
    result = await syncer.sync(pool.handles())
    assert (result.version, sorted(result.synced)) == (3, ["a", "b"])
    assert [r.rollout_id for r in learner.receivers[-1]] == ["a", "b"]  # named for collective transports
    assert learner.receivers[-1][0].instance_id == "a-1" and learner.receivers[-1][0].workers == 1
    assert a.commits == b.commits == [3] and {h.version for h in pool.handles()} == {3}
    assert learner.released == [3] and not learner.prepared
    assert result.total_ms >= result.prepare_ms + result.stage_ms
    assert not any(h.syncing for h in pool.handles())
    row = result.record()  # the step row's bytes: the version's payload, once per rollout that staged it
    assert (row["sync_version_bytes"], row["sync_bytes"]) == (1003, 2 * 1003)


@pytest.mark.parametrize(
    ("error", "reachable"),
    [
        (InvalidArgument("bad manifest"), True),
        (Unavailable("gone"), False),
        (DeadlineExceeded("slow"), False),
    ],
)
async def test_a_failing_rollout_is_dropped_from_the_sync_and_the_others_move_on(
    error, reachable: bool
) -> None:
    good, bad = FakeRollout("good"), FakeRollout("bad", fail_stage=[error])
    syncer, learner, pool = await _setup(good, bad)
    learner.version = 1
    result = await syncer.sync(pool.handles())
    assert result.synced == ["good"] and good.commits == [1] and not bad.commits
    assert result.moved_bytes == result.version_bytes == 1001  # a rollout that failed to stage is not counted
    assert bad.aborts == ([1] if reachable else [])  # an unreachable rollout is not asked to abort
    handles = {h.address: h for h in pool.handles()}
    assert handles["good"].healthy and not handles["good"].needs_sync
    # unreachable: unhealthy until it answers again; reachable: healthy, but no work until re-synced
    assert handles["bad"].healthy == reachable and not handles["bad"].slot().healthy
    assert learner.released == [1]  # released even though one rollout failed


async def test_a_failure_in_commit_also_drops_only_that_rollout() -> None:
    good, bad = FakeRollout("good"), FakeRollout("bad")
    syncer, learner, pool = await _setup(good, bad)
    learner.version = 2

    async def refuse(version: int, rewind: bool = False, deadline_s: float | None = None) -> int:
        raise FailedPrecondition("load failed")

    bad.commit = refuse
    result = await syncer.sync(pool.handles())
    assert result.synced == ["good"] and bad.aborts == [2]


async def test_probe_measures_the_worst_difference_and_skips_unreachable_rollouts() -> None:
    near, far, dead = (
        FakeRollout("near", logprob_offset=1e-5),
        FakeRollout("far", logprob_offset=3e-4),
        FakeRollout("dead"),
    )
    syncer, _, pool = await _setup(near, far, dead)
    dead.alive = False
    assert max(await syncer.probe(PROBE, pool.handles())) == pytest.approx(3e-4)
    assert [h.address for h in pool.healthy()] == ["near", "far"]


async def test_a_probe_no_rollout_answered_is_none_not_agreement() -> None:
    dead = FakeRollout("dead")
    syncer, _, pool = await _setup(dead)
    dead.alive = False
    assert await syncer.probe(PROBE, pool.handles()) is None
    assert await syncer.probe(PROBE, []) is None  # no rollout held the version


async def test_a_nan_logprob_is_the_worst_disagreement() -> None:
    rollout = FakeRollout("r")
    syncer, _, pool = await _setup(rollout)

    async def nan_last(sequence):
        from services.scheduler.peers.clients import TokenScores

        return TokenScores([-1.0, math.nan], 0)

    rollout.score_tokens = nan_last
    assert await syncer.probe(PROBE, pool.handles()) == [pytest.approx(0.0, abs=1e-9), math.inf]


async def test_probe_refuses_a_version_mismatch_and_a_length_mismatch() -> None:
    rollout = FakeRollout("r")
    syncer, learner, pool = await _setup(rollout)
    learner.version = 1
    with pytest.raises(FailedPrecondition, match="probe version mismatch: learner v1, r v0"):
        await syncer.probe(PROBE, pool.handles())
    learner.version = 0

    async def short(sequence):
        from services.scheduler.peers.clients import TokenScores

        return TokenScores([-1.0], 0)

    rollout.score_tokens = short
    with pytest.raises(AlignmentError, match="scored 1 tokens, learner 2"):
        await syncer.probe(PROBE, pool.handles())


async def test_probe_asks_the_learner_and_every_rollout_at_once() -> None:
    """One round trip per sync, not one per rollout: every rollout's scoring is in flight together."""
    rollouts = [FakeRollout(f"r{i}") for i in range(3)]
    syncer, learner, pool = await _setup(*rollouts)
    in_flight, most = 0, 0

    def counting(score):
        async def scored(sequence):
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            await asyncio.sleep(0.01)
            in_flight -= 1
            return await score(sequence)

        return scored

    learner.score_tokens = counting(learner.score_tokens)
    for rollout in rollouts:
        rollout.score_tokens = counting(rollout.score_tokens)
    assert max(await syncer.probe(PROBE, pool.handles())) == 0.0
    assert most == 4


async def test_a_rollout_silent_mid_sync_is_not_vouched_for_until_its_state_is_read() -> None:
    """The cuda_ipc fence: the learner is told what each rollout serves for certain; one that did not
    answer a stage may have loaded the version or not, so it is left out until it answers again."""
    good, silent = FakeRollout("good", rollout_id="rg"), FakeRollout("silent", rollout_id="rs")
    silent.fail_stage = [DeadlineExceeded("silent: deadline")]
    syncer, learner, pool = await _setup(good, silent)
    learner.version = 1
    await syncer.sync(pool.handles())
    assert {h.rollout_id: h.version for h in learner.holders[-1]} == {"rg": 0, "rs": 0}
    learner.version = 2
    await syncer.sync(pool.healthy())
    assert {h.rollout_id: h.version for h in learner.holders[-1]} == {"rg": 1}  # rs: unknown
    await pool.refresh_all(2)  # it answers again: its state is what it serves
    learner.version = 3
    await syncer.sync(pool.healthy())
    assert {h.rollout_id: h.version for h in learner.holders[-1]} == {"rg": 2, "rs": 0}
