"""The scheduler's view of its rollout workers: clients, credits, versions and health.

A handle is usable for new work when it is healthy, not in a weight sync, and not flagged
`needs_sync`: a rollout that (re)joins with weights other than the run's current version, or whose
last stage/commit failed (and was aborted), gets the current version before any work, whatever the
staleness bound would allow.

The pool is bounded: at most `max_rollouts` handles, and a rollout that joined with RegisterWorker
and has not answered for `forget_after` seconds is forgotten (the configured ones are kept: a
supervisor brings them back), so bogus or dead registrations cannot grow the pool or GetStatus.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from services.common.errors import GrpoError, ResourceExhausted, Unavailable
from services.common.logging import get_logger
from services.scheduler.peers.clients import RolloutClient
from services.scheduler.peers.own_pause import PauseWatch
from services.scheduler.peers.placement import RolloutSlot, choose_rollout, credits_taken
from services.transports.cuda_ipc_fence import Holder

log = get_logger(__name__)
T = TypeVar("T")


@dataclass
class RolloutHandle:
    address: str
    client: RolloutClient
    rollout_id: str = ""
    version: int = -1
    in_flight: int = 0
    max_in_flight: int = 1
    healthy: bool = False
    syncing: bool = False
    needs_sync: bool = False
    weight_workers: int = 1
    instance_id: str = ""
    max_model_len: int = 0
    registered: bool = False  # joined with RegisterWorker (forgotten when unreachable too long)
    unreachable_since: float | None = field(default_factory=time.monotonic)  # None while healthy
    # its `version` is what it serves for certain: false from a stage or commit it did not answer
    # (it may have loaded the version or not) until its state is read again
    version_known: bool = True
    # generation calls in flight on it: cancelled when it is taken out of work (`RolloutPool.mark`)
    generating: set[asyncio.Future] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.rollout_id or self.address

    @property
    def usable(self) -> bool:
        """Healthy and free for new work: not in a weight sync and not waiting for one."""
        return self.healthy and not self.syncing and not self.needs_sync

    def slot(self) -> RolloutSlot:
        return RolloutSlot(self.name, self.in_flight, self.max_in_flight, self.version, self.usable)


async def abandonable(handle: RolloutHandle, call: Awaitable[T]) -> T:
    """`call` on `handle`, given up (Unavailable) when the pool takes the rollout out of work meanwhile
    (`RolloutPool.mark`): the group is re-issued to another rollout."""
    future = asyncio.ensure_future(call)
    handle.generating.add(future)
    try:
        return await future
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if not future.cancelled() or (current is not None and current.cancelling()):
            raise  # this task itself is being cancelled
        raise Unavailable(f"rollout {handle.name} stopped answering: group given up") from None
    finally:
        handle.generating.discard(future)
        if not future.done():
            future.cancel()


class RolloutPool:
    """All known rollouts; `changed` is notified whenever credits, health or versions move."""

    def __init__(
        self, connect: Callable[[str], RolloutClient], max_rollouts: int = 256, forget_after: float = 300.0
    ) -> None:
        self._connect = connect
        self._by_address: dict[str, RolloutHandle] = {}
        self.max_rollouts = max_rollouts
        self.forget_after = forget_after
        self._closing: set[asyncio.Task] = set()
        self.changed = asyncio.Condition()
        self.pause_watch = PauseWatch()  # the scheduler's own stillness (run by the orchestrator)

    def add(self, address: str, registered: bool = False) -> RolloutHandle:
        """The handle for `address` (created unhealthy; the next refresh finds out its state)."""
        if address not in self._by_address:
            if len(self._by_address) >= self.max_rollouts:
                self.forget_unreachable()
            if len(self._by_address) >= self.max_rollouts:
                raise ResourceExhausted(
                    f"{len(self._by_address)} rollouts known (max {self.max_rollouts}); registered ones "
                    f"that stay unreachable are forgotten after {self.forget_after:g}s"
                )
            self._by_address[address] = RolloutHandle(address, self._connect(address), registered=registered)
        return self._by_address[address]

    def forget_unreachable(self) -> list[str]:
        """Drop registered rollouts unreachable for `forget_after` s with no work or sync on them."""
        now = time.monotonic()
        gone = [
            h
            for h in self._by_address.values()
            if h.registered
            and not h.healthy
            and h.in_flight == 0
            and not h.syncing
            and h.unreachable_since is not None
            and now - h.unreachable_since >= self.forget_after
        ]
        for handle in gone:
            del self._by_address[handle.address]
            task = asyncio.ensure_future(handle.client.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
            log.warning("forgot an unreachable registered rollout", address=handle.address)
        return [h.address for h in gone]

    def handles(self) -> list[RolloutHandle]:
        return list(self._by_address.values())

    def healthy(self) -> list[RolloutHandle]:
        return [h for h in self._by_address.values() if h.healthy]

    def behind(self, version: int) -> list[RolloutHandle]:
        """Healthy rollouts a sync to `version` must target: not holding it, or flagged `needs_sync`."""
        return [h for h in self.healthy() if h.version != version or h.needs_sync]

    def lagging(self, version: int) -> list[RolloutHandle]:
        """Healthy rollouts older than `version` or flagged `needs_sync` (what a health round syncs)."""
        return [h for h in self.healthy() if h.version < version or h.needs_sync]

    def holding(self, version: int) -> list[RolloutHandle]:
        """Healthy rollouts serving `version`."""
        return [h for h in self.healthy() if h.version == version]

    # ---- weight syncs (pipeline/weight_sync.py moves the weights; the pool keeps the state) --------

    def begin_sync(self, handles: list[RolloutHandle]) -> None:
        """`handles` take no new work until `end_sync`."""
        for handle in handles:
            handle.syncing = True

    def end_sync(self, handles: list[RolloutHandle]) -> None:
        for handle in handles:
            handle.syncing = False

    def committed(self, handles: list[RolloutHandle], version: int) -> None:
        """`handles` serve `version` now (a flag from an earlier failed sync is cleared)."""
        for handle in handles:
            handle.version, handle.needs_sync = version, False

    def holders(self) -> list[Holder]:
        """What every rollout whose version is known for certain serves (healthy, or unreachable with
        nothing sent to it since its last acknowledged commit): the cuda_ipc fence's `holders`."""
        return [
            Holder(h.rollout_id, h.instance_id, h.version)
            for h in self._by_address.values()
            if h.version_known and h.rollout_id and h.version >= 0
        ]

    async def lost_mid_sync(self, handle: RolloutHandle, started: float) -> None:
        """`handle` did not answer a stage or commit sent at `started` (monotonic): its version is
        uncertain until its state is read again, and it is out of work, unless it was the scheduler
        that stood still meanwhile (then it only waits for its next sync, its groups kept)."""
        handle.version_known = False
        if self.pause_watch.stood_still_since(started):
            log.info("sync missed while the scheduler stood still", rollout=handle.name)
            handle.needs_sync = True
            return
        await self.mark(handle, healthy=False)

    def silent(self, started: float) -> bool:
        """A call sent at `started` went unanswered for the callee's fault (not the scheduler's own
        stillness)."""
        return not self.pause_watch.stood_still_since(started)

    def hold_for_sync(self, handle: RolloutHandle) -> None:
        """No work for `handle` until a later sync succeeds (its last stage or commit failed)."""
        handle.needs_sync = True

    def require_sync_above(self, version: int) -> None:
        """Every rollout holding weights newer than `version` (of a learner lineage that was lost when
        the learner came back from an older checkpoint) must go back to the learner's before any work."""
        for handle in self._by_address.values():
            if handle.version > version:
                handle.needs_sync = True

    async def refresh(self, handle: RolloutHandle, current_version: int) -> None:
        """Poll one rollout's state; mark it unhealthy if it does not answer in time. A rollout that
        becomes healthy with weights other than `current_version` must be synced before any work."""
        started = time.monotonic()
        try:
            info = await handle.client.state()
        except GrpoError as exc:
            if exc.unreachable and not self.silent(started):
                return  # the scheduler stood still, not the rollout: ask again next round
            if handle.healthy:
                log.warning("rollout unreachable", address=handle.address, error=str(exc))
            await self.mark(handle, healthy=False)
            return
        handle.rollout_id = info.rollout_id
        handle.version, handle.version_known = info.weight_version, True
        handle.max_in_flight = max(1, info.max_in_flight)
        handle.weight_workers, handle.instance_id = info.weight_workers, info.instance_id
        handle.max_model_len = info.max_model_len
        if info.ready and not handle.healthy:
            # sticky: a rollout flagged (failed sync, or weights of a lineage the learner lost) stays so
            handle.needs_sync = handle.needs_sync or handle.version != current_version
            log.info(
                "rollout healthy", rollout=handle.name, version=handle.version, needs_sync=handle.needs_sync
            )
        await self.mark(handle, healthy=info.ready)

    async def refresh_all(self, current_version: int) -> None:
        await asyncio.gather(*(self.refresh(h, current_version) for h in self.handles()))
        self.forget_unreachable()

    async def wait_for_healthy(self, current_version: int, timeout_s: float, poll_s: float) -> None:
        """Poll every rollout until one is ready (one may be restarting); RuntimeError after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            await self.refresh_all(current_version)
            if self.healthy():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no rollout became ready within {timeout_s:g} s")
            await asyncio.sleep(poll_s)

    async def mark(self, handle: RolloutHandle, *, healthy: bool) -> None:
        """Set `handle`'s health. One taken out of work (it did not answer: dead, frozen or cut off)
        gives up its generation calls in flight: their groups go to other rollouts now, not when its
        call's deadline passes (a frozen rollout holds its groups, and with them the staleness
        budget of admission, for as long as it is frozen)."""
        async with self.changed:
            handle.healthy = healthy
            if healthy:
                handle.unreachable_since = None
            else:
                if handle.unreachable_since is None:
                    handle.unreachable_since = time.monotonic()
                for call in handle.generating:
                    call.cancel()
            self.changed.notify_all()

    async def acquire(
        self, train_version: Callable[[], int], max_staleness: int, cost: int = 1
    ) -> RolloutHandle:
        """Wait for a rollout with `cost` free credits (all of them, on one whose max_in_flight is
        smaller: a multi-turn group's G episodes are G requests at once) whose weights are at most
        `max_staleness` versions older than `train_version()` (re-evaluated on every change), and
        take them. `credits_taken(handle, cost)` says how many that was: release as many."""
        handles = self._by_address.values()
        handle = choose_rollout(handles, train_version(), max_staleness, cost)
        if handle is None:  # nothing free now: wait for a change (the lock is only needed to wait)
            async with self.changed:
                while (handle := choose_rollout(handles, train_version(), max_staleness, cost)) is None:
                    await self.changed.wait()
        handle.in_flight += credits_taken(handle, cost)
        return handle

    async def release(self, handle: RolloutHandle, credits: int = 1) -> None:
        async with self.changed:
            handle.in_flight -= credits
            self.changed.notify_all()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def close(self) -> None:
        await asyncio.gather(*(h.client.close() for h in self.handles()))
