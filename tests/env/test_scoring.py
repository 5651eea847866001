"""Isolated scoring: exceptions, hangs, crashes, NaN / out-of-range / missing rewards become failures;
the pool kills and replaces bad workers and keeps serving."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest

from services.common.errors import ResourceExhausted
from services.env.base import PromptItem, Score
from services.env.loader import EnvLoadError, EnvRecipe
from services.env.scoring import ScoringPool, validate_scores

FAULTY = str(Path(__file__).parent / "faulty_envs.py")
PROMPT = PromptItem(id="faulty-train-0", text="say 0", reference_answer="0")


def kinds(scores: list[Score]) -> list[str]:
    return [s.details.get("failure_kind", "ok") if s.failure else "ok" for s in scores]


def test_validate_scores() -> None:
    got = validate_scores([1.0, math.nan, math.inf, 5.0, None, Score(0.5), "x", True], 8, (0.0, 1.0))
    assert kinds(got) == [
        "ok",
        "non_finite",
        "non_finite",
        "out_of_range",
        "no_reward",
        "ok",
        "bad_output",
        "ok",
    ]
    assert got[7].reward == 1.0
    assert kinds(validate_scores([1.0], 2, (0.0, 1.0))) == ["bad_output", "bad_output"]
    assert kinds(validate_scores(3.0, 2, (0.0, 1.0))) == ["bad_output", "bad_output"]
    failed = validate_scores([Score(None, failure="could not parse")], 1, (0.0, 1.0))
    assert failed[0].failure == "could not parse" and kinds(failed) == ["scorer"]


async def test_pool_records_failures_and_recovers() -> None:
    pool = ScoringPool(EnvRecipe(f"{FAULTY}:FaultyEnv"), workers=1, timeout=2.0, max_pending=1)
    await pool.start()
    try:
        ok = await pool.score(PROMPT, ["0", "7"])
        assert [s.reward for s in ok] == [1.0, 0.0] and kinds(ok) == ["ok", "ok"]
        assert kinds(await pool.score(PROMPT, ["0", "nan"])) == ["ok", "non_finite"]
        assert kinds(await pool.score(PROMPT, ["huge", "0"])) == ["out_of_range", "ok"]
        assert kinds(await pool.score(PROMPT, ["none"])) == ["no_reward"]
        assert kinds(await pool.score(PROMPT, ["0", "short"])) == ["bad_output", "bad_output"]
        raised = await pool.score(PROMPT, ["0", "raise"])
        assert kinds(raised) == ["exception", "exception"] and "scorer exploded" in raised[0].failure
        assert pool.counters["worker_restarts"] == 0  # an exception does not cost the worker

        hang = asyncio.ensure_future(pool.score(PROMPT, ["sleep", "0"]))
        await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted, match="already waiting"):
            await pool.score(PROMPT, ["0"])
        assert kinds(await hang) == ["timeout", "timeout"]
        assert pool.counters["worker_restarts"] == 1
        assert [s.reward for s in await pool.score(PROMPT, ["0"])] == [1.0]  # the replacement serves

        crashed = await pool.score(PROMPT, ["crash"])
        assert kinds(crashed) == ["crash"] and "exit code 7" in crashed[0].failure
        assert [s.reward for s in await pool.score(PROMPT, ["0"])] == [1.0]
        assert pool.counters["worker_restarts"] == 2
        assert pool.counters["failures.timeout"] == 2 and pool.counters["failures.crash"] == 1
        assert pool.counters["failures.exception"] == 2 and pool.counters["failures.non_finite"] == 1
    finally:
        await pool.close()


async def test_trl_reward_functions_that_raise_hang_or_return_nan() -> None:
    recipe = EnvRecipe("arithmetic", reward_funcs=(f"{FAULTY}:raising_reward",), env_reward_weight=0.0)
    pool = ScoringPool(recipe, workers=1, timeout=2.0)
    await pool.start()
    try:
        scores = await pool.score(PromptItem(id="a", text="1+1=", reference_answer="2"), ["2", "3"])
        assert kinds(scores) == ["exception", "exception"]
        assert "reward function raised on purpose" in scores[0].failure
    finally:
        await pool.close()

    for func, kind in (("nan_reward", "non_finite"), ("sleeping_reward", "timeout")):
        pool = ScoringPool(
            EnvRecipe("arithmetic", reward_funcs=(f"{FAULTY}:{func}",)), workers=1, timeout=2.0
        )
        await pool.start()
        try:
            assert kinds(await pool.score(PromptItem(id="a", text="1+1=", reference_answer="2"), ["2"])) == [
                kind
            ]
        finally:
            await pool.close()


async def test_workers_rebuild_the_composed_scorer_from_the_recipe() -> None:
    recipe = EnvRecipe("arithmetic", reward_funcs=("answer_tags",), reward_weights=(0.5,))
    pool = ScoringPool(recipe, workers=1, timeout=10.0)
    await pool.start()
    try:
        assert pool.reward_range == (0.0, 1.5)  # the composite's range, reported by the worker
        prompt = PromptItem(id="a", text="1+1=", reference_answer="2")
        scores = await pool.score(prompt, ["<answer>2</answer>", "2", "<answer>3</answer>"])
        assert [s.reward for s in scores] == [1.5, 1.0, 0.5]  # as RewardFunctionScorer in-process
    finally:
        await pool.close()


async def test_pool_start_reports_load_errors() -> None:
    pool = ScoringPool(EnvRecipe(f"{FAULTY}:NoSuchEnv"), workers=1)
    with pytest.raises(EnvLoadError, match="has no attribute 'NoSuchEnv'"):
        await pool.start()


async def test_a_hung_call_does_not_hold_up_the_others() -> None:
    """One worker, stuck on a reward that hangs: the next call gets a spare worker and is scored
    while the stuck call still runs; the stuck call still ends as a recorded timeout, and the spare
    stops once nobody waits for it."""
    pool = ScoringPool(
        EnvRecipe(f"{FAULTY}:FaultyEnv"), workers=1, max_workers=2, spare_after=0.2, timeout=20.0
    )
    await pool.start()
    try:
        hung = asyncio.ensure_future(pool.score(PROMPT, ["sleep", "0"]))
        await asyncio.sleep(0)
        scored = await pool.score(PROMPT, ["0", "7"])
        assert [s.reward for s in scored] == [1.0, 0.0]
        assert not hung.done()  # scored while the hung call still holds the first worker
        assert pool.counters["spare_workers_started"] == 1
        hung.cancel()  # the caller gives up; close() below stops the stuck worker
        with pytest.raises(asyncio.CancelledError):
            await hung
    finally:
        await pool.close()


async def test_spare_workers_stop_when_idle_and_timeouts_are_recorded() -> None:
    pool = ScoringPool(
        EnvRecipe(f"{FAULTY}:FaultyEnv"), workers=1, max_workers=2, spare_after=0.2, timeout=3.0
    )
    await pool.start()
    try:
        hung = asyncio.ensure_future(pool.score(PROMPT, ["sleep"]))
        await asyncio.sleep(0)
        assert [s.reward for s in await pool.score(PROMPT, ["0"])] == [1.0]
        assert len(pool._workers) == 1  # the spare came back with nobody waiting: stopped
        assert kinds(await hung) == ["timeout"]
        assert pool.counters["failures.timeout"] == 1
        assert [s.reward for s in await pool.score(PROMPT, ["0"])] == [1.0]
    finally:
        await pool.close()
