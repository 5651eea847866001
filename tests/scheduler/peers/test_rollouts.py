"""RolloutPool: health from state polls, least-loaded admission with credits, and the first-sync rule."""

from __future__ import annotations

import asyncio

import pytest

from grpo.common.v1 import types_pb2
from services.common.errors import ResourceExhausted, Unavailable
from services.scheduler.peers.clients import Sampling
from services.scheduler.peers.rollouts import RolloutHandle, RolloutPool, abandonable
from tests.scheduler.fakes import FakeRollout


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


async def test_the_pool_is_bounded_and_forgets_dead_registrations() -> None:
    """Configured rollouts stay; registered ones that never answer are forgotten after forget_after,
    which makes room again; beyond max_rollouts a registration is RESOURCE_EXHAUSTED."""
    rollouts = {name: FakeRollout(name, alive=False) for name in ("configured", "r1", "r2", "r3")}
    pool = RolloutPool(lambda address: rollouts[address], max_rollouts=3, forget_after=0.05)
    pool.add("configured")
    pool.add("r1", registered=True)
    pool.add("r2", registered=True)
    assert pool.add("r2", registered=True) is pool.add("r2")  # the same address twice: one handle
    await asyncio.sleep(0)
    pool.forget_after = 3600.0
    with pytest.raises(ResourceExhausted, match="max 3"):
        pool.add("r3", registered=True)
    pool.forget_after = 0.0
    await pool.refresh_all(current_version=0)  # r1 and r2 unreachable: forgotten, configured kept
    assert sorted(h.address for h in pool.handles()) == ["configured"]
    rollouts["r3"].alive = True
    pool.add("r3", registered=True)
    await pool.refresh_all(current_version=0)
    assert [h.address for h in pool.healthy()] == ["r3"]


async def _generating(name: str) -> tuple[RolloutPool, RolloutHandle, asyncio.Task]:
    """A pool of one rollout whose generation never ends, and a generation call in flight on it."""
    rollout = FakeRollout(name, gate=asyncio.Event())
    pool = _pool(rollout)
    await pool.refresh_all(current_version=0)
    handle = pool.handles()[0]
    sampling = Sampling(n=2, temperature=1.0, max_tokens=4)
    call = asyncio.create_task(
        abandonable(handle, handle.client.generate("g1", types_pb2.Prompt(id="p"), sampling))
    )
    await asyncio.sleep(0.01)
    assert not call.done() and len(handle.generating) == 1
    return pool, handle, call


async def test_a_rollout_taken_out_of_work_gives_up_its_generation_calls() -> None:
    """A frozen rollout holds its groups until its call's deadline unless the pool lets them go when
    it takes the rollout out of work (a missed stage, probe or health poll)."""
    pool, handle, call = await _generating("frozen")
    await pool.mark(handle, healthy=False)
    with pytest.raises(Unavailable, match="rollout frozen stopped answering"):
        await asyncio.wait_for(call, 5)
    assert not handle.generating


async def test_cancelling_the_caller_is_not_mistaken_for_a_lost_rollout() -> None:
    _, handle, call = await _generating("slow")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not handle.generating and handle.healthy
