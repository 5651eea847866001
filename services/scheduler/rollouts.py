"""The scheduler's view of its rollout workers: clients, credits, versions and health.

A handle is usable for new work when it is healthy, not in a weight sync, and not flagged
`needs_sync`: a rollout that (re)joins with weights other than the run's current version, or whose
last stage/commit failed (and was aborted), gets the current version before any work, whatever the
staleness bound would allow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.scheduler.clients import RolloutClient
from services.scheduler.policy import RolloutSlot, choose_rollout

log = get_logger(__name__)


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

    @property
    def name(self) -> str:
        return self.rollout_id or self.address

    @property
    def usable(self) -> bool:
        """Healthy and free for new work: not in a weight sync and not waiting for one."""
        return self.healthy and not self.syncing and not self.needs_sync

    def slot(self) -> RolloutSlot:
        return RolloutSlot(self.name, self.in_flight, self.max_in_flight, self.version, self.usable)


class RolloutPool:
    """All known rollouts; `changed` is notified whenever credits, health or versions move."""

    def __init__(self, connect: Callable[[str], RolloutClient]) -> None:
        self._connect = connect
        self._by_address: dict[str, RolloutHandle] = {}
        self.changed = asyncio.Condition()

    def add(self, address: str) -> RolloutHandle:
        """The handle for `address` (created unhealthy; the next refresh finds out its state)."""
        if address not in self._by_address:
            self._by_address[address] = RolloutHandle(address, self._connect(address))
        return self._by_address[address]

    def handles(self) -> list[RolloutHandle]:
        return list(self._by_address.values())

    def healthy(self) -> list[RolloutHandle]:
        return [h for h in self._by_address.values() if h.healthy]

    def behind(self, version: int) -> list[RolloutHandle]:
        """Healthy rollouts a sync to `version` must target: not holding it, or flagged `needs_sync`."""
        return [h for h in self.healthy() if h.version != version or h.needs_sync]

    async def refresh(self, handle: RolloutHandle, current_version: int) -> None:
        """Poll one rollout's state; mark it unhealthy if it does not answer in time. A rollout that
        becomes healthy with weights other than `current_version` must be synced before any work."""
        try:
            info = await handle.client.state()
        except GrpoError as exc:
            if handle.healthy:
                log.warning("rollout unreachable", address=handle.address, error=str(exc))
            await self.mark(handle, healthy=False)
            return
        handle.rollout_id = info.rollout_id
        handle.version = info.weight_version
        handle.max_in_flight = max(1, info.max_in_flight)
        handle.weight_workers, handle.instance_id = info.weight_workers, info.instance_id
        if info.ready and not handle.healthy:
            # sticky: a rollout flagged (failed sync, or weights of a lineage the learner lost) stays so
            handle.needs_sync = handle.needs_sync or handle.version != current_version
            log.info(
                "rollout healthy", rollout=handle.name, version=handle.version, needs_sync=handle.needs_sync
            )
        await self.mark(handle, healthy=info.ready)

    async def refresh_all(self, current_version: int) -> None:
        await asyncio.gather(*(self.refresh(h, current_version) for h in self.handles()))

    async def mark(self, handle: RolloutHandle, *, healthy: bool) -> None:
        async with self.changed:
            handle.healthy = healthy
            self.changed.notify_all()

    async def acquire(self, train_version: Callable[[], int], max_staleness: int) -> RolloutHandle:
        """Wait for a rollout with a free credit whose weights are at most `max_staleness` versions
        older than `train_version()` (re-evaluated on every change), and take one credit on it."""
        handles = self._by_address.values()
        handle = choose_rollout(handles, train_version(), max_staleness)
        if handle is None:  # nothing free now: wait for a change (the lock is only needed to wait)
            async with self.changed:
                while (handle := choose_rollout(handles, train_version(), max_staleness)) is None:
                    await self.changed.wait()
        handle.in_flight += 1
        return handle

    async def release(self, handle: RolloutHandle) -> None:
        async with self.changed:
            handle.in_flight -= 1
            self.changed.notify_all()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def close(self) -> None:
        await asyncio.gather(*(h.client.close() for h in self.handles()))
