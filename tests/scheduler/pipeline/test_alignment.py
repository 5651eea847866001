"""The post-sync probe against in-memory peers: a multi-turn probe's environment tokens are reported
apart from the sampled ones, every token is held to the threshold, a probe no one answered is NaN, and
the probe is scored at `alignment_probe_temperature`."""

from __future__ import annotations

import math

import pytest

from services.scheduler.config import SchedulerSettings
from services.scheduler.peers.clients import TokenScores
from services.scheduler.peers.rollouts import RolloutPool
from services.scheduler.pipeline.alignment import Alignment, AlignmentProbe
from services.scheduler.pipeline.weight_sync import AlignmentError, WeightSyncer
from services.transports import TransportKind
from tests.scheduler.fakes import FakeEnv, FakeLearner, FakeRollout


async def _probe(rollout: FakeRollout, **settings) -> tuple[AlignmentProbe, RolloutPool]:
    pool = RolloutPool(lambda address: rollout)
    pool.add(rollout.address)
    await pool.refresh_all(0)
    syncer = WeightSyncer(FakeLearner(), pool, TransportKind.shared_memory)
    probe = AlignmentProbe(SchedulerSettings(**settings), syncer)
    probe.multi_turn = True
    await probe.make(FakeEnv(), pool)
    return probe, pool


def _rollout_scoring(offsets: list[float]) -> FakeRollout:
    rollout = FakeRollout("r")

    async def score(sequence):
        assert len(sequence.completion_token_ids) == len(offsets)
        return TokenScores([-1.0 + o for o in offsets], rollout.version)

    rollout.score_tokens = score
    return rollout


async def test_a_multi_turn_probe_reports_environment_tokens_apart() -> None:
    # turn one (3 tokens), the bridge of one user message (2), turn two (3)
    rollout = _rollout_scoring([1e-6, 0, 0, 5e-5, 2e-5, 0, 3e-6, 0])
    probe, pool = await _probe(rollout)
    assert list(probe.sequence.completion_token_ids) == [3, 4, 5, 9, 9, 3, 4, 5] and probe.env_spans == [
        (3, 5)
    ]
    result = await probe.check(pool.healthy(), 0)
    assert result.sampled == pytest.approx(3e-6) and result.env == pytest.approx(5e-5)


async def test_every_token_is_held_to_the_threshold() -> None:
    rollout = _rollout_scoring([0, 0, 0, 0.5, 0, 0, 0, 0])  # far off on an environment token only
    probe, pool = await _probe(rollout, alignment_threshold=1e-3)
    with pytest.raises(AlignmentError, match=r"0 on sampled tokens, 0\.5 on environment tokens"):
        await probe.check(pool.healthy(), 0)


async def test_a_probe_no_rollout_answered_is_nan_on_both() -> None:
    probe, _ = await _probe(FakeRollout("r"))
    result = await probe.check([], 0)
    assert math.isnan(result.sampled) and math.isnan(result.env) and math.isnan(result.worst)
    assert Alignment(sampled=1e-6).worst == 1e-6  # a single-turn probe has no environment tokens


async def test_the_probe_is_scored_at_its_own_temperature_or_the_sampling_one() -> None:
    """Default 1.0 (one prompt-logprobs request on vLLM); 0 = the run's sampling temperature."""
    probe, _ = await _probe(FakeRollout("r"), sampling={"temperature": 0.7})
    assert probe.sequence.temperature == 1.0
    probe, _ = await _probe(FakeRollout("r"), sampling={"temperature": 0.7}, alignment_probe_temperature=0)
    assert probe.sequence.temperature == pytest.approx(0.7)
