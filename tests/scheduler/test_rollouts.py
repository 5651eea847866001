"""RolloutPool: health from state polls, least-loaded admission with credits, and the first-sync rule."""

from __future__ import annotations

import asyncio

from services.scheduler.rollouts import RolloutPool

from .fakes import FakeRollout


def _pool(*rollouts: FakeRollout) -> RolloutPool:
    by_address = {r.address: r for r in rollouts}
    pool = RolloutPool(lambda address: by_address[address])
    for rollout in rollouts:
        pool.add(rollout.address)
    return pool


async def test_refresh_learns_state_and_marks_unreachable_rollouts_unhealthy() -> None:
    a, b = FakeRollout("a", rollout_id="ra", version=2, max_in_flight=3), FakeRollout("b", alive=False)
    pool = _pool(a, b)
    assert pool.add("a") is pool.add("a")  # one handle per address
    await pool.refresh_all(current_version=2)
    handles = {h.address: h for h in pool.handles()}
    assert (handles["a"].name, handles["a"].version, handles["a"].max_in_flight) == ("ra", 2, 3)
    assert handles["a"].healthy and not handles["a"].needs_sync
    assert not handles["b"].healthy
    a.alive = False
    await pool.refresh_all(current_version=2)
    assert pool.healthy() == []


async def test_a_rollout_joining_with_other_weights_needs_a_sync_before_work() -> None:
    fresh = FakeRollout("fresh", version=0)
    pool = _pool(fresh)
    await pool.refresh_all(current_version=5)
    handle = pool.handles()[0]
    assert handle.healthy and handle.needs_sync and not handle.slot().healthy
    acquiring = asyncio.create_task(pool.acquire(lambda: 0, max_staleness=10))
    await asyncio.sleep(0)
    assert not acquiring.done()  # staleness 10 would allow v0, the first-sync rule does not
    handle.version, handle.needs_sync = 5, False
    await pool.notify()
    assert await asyncio.wait_for(acquiring, 1) is handle


async def test_acquire_takes_credits_from_the_least_loaded_fresh_rollout_and_waits_when_full() -> None:
    a, b = FakeRollout("a", max_in_flight=2), FakeRollout("b", max_in_flight=1)
    pool = _pool(a, b)
    await pool.refresh_all(current_version=0)
    taken = [await pool.acquire(lambda: 0, 0) for _ in range(3)]
    assert sorted(h.address for h in taken) == ["a", "a", "b"]
    waiting = asyncio.create_task(pool.acquire(lambda: 0, 0))
    await asyncio.sleep(0)
    assert not waiting.done()
    await pool.release(taken[-1])
    assert (await asyncio.wait_for(waiting, 1)).address == taken[-1].address
