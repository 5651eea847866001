"""PauseWatch: a scheduler that itself stood still does not blame its rollouts for its deadlines."""

from __future__ import annotations

import asyncio
import time

from services.common.errors import DeadlineExceeded
from services.scheduler.peers.own_pause import PauseWatch
from services.scheduler.peers.rollouts import RolloutPool
from services.scheduler.pipeline.weight_sync import WeightSyncer
from services.transports import TransportKind
from tests.scheduler.fakes import FakeLearner, FakeRollout


async def test_a_loop_that_stood_still_is_noticed_now_and_afterwards() -> None:
    watch = PauseWatch(tick_s=0.05, threshold_s=0.3)
    assert not watch.stood_still_since(time.monotonic() - 10)  # not watching: nothing is a pause
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0.2)
    before = time.monotonic()
    assert not watch.stood_still_since(before - 1)
    time.sleep(0.6)  # noqa: ASYNC251 (the process stands still, as under SIGSTOP: no tick runs)
    assert watch.stood_still_since(before)  # on waking, before the late tick
    await asyncio.sleep(0.1)
    assert len(watch.pauses) == 1 and watch.stood_still_since(before)
    assert not watch.stood_still_since(time.monotonic())  # a call sent after the pause
    task.cancel()


async def test_a_stage_missed_while_the_scheduler_stood_still_keeps_the_rollout_in_work() -> None:
    """The rollout answered in time; the scheduler woke up past the deadline: the rollout misses this
    sync (it waits for the next) but stays healthy, its groups in flight kept."""
    rollout = FakeRollout("r", fail_stage=[DeadlineExceeded("r: deadline")])
    pool = RolloutPool(lambda address: rollout)
    pool.add("r")
    await pool.refresh_all(0)
    watch = asyncio.create_task(pool.pause_watch.run())
    await asyncio.sleep(0.01)
    learner = FakeLearner()
    learner.version = 1
    syncer = WeightSyncer(learner, pool, TransportKind.shared_memory)

    async def stage_while_the_scheduler_stands_still(*args, **kwargs) -> None:
        time.sleep(1.5)  # noqa: ASYNC251 (the scheduler stands still past the threshold)
        raise DeadlineExceeded("r: deadline")

    rollout.stage = stage_while_the_scheduler_stands_still
    result = await syncer.sync(pool.handles())
    handle = pool.handles()[0]
    assert result.synced == [] and handle.healthy and handle.needs_sync and not handle.version_known
    watch.cancel()
