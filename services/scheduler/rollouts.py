"""The scheduler's view of its rollout workers: channels, credits, versions and health."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import open_channel
from services.common.logging import get_logger
from services.scheduler.policy import RolloutSlot, pick_rollout

log = get_logger(__name__)


@dataclass
class RolloutHandle:
    address: str
    channel: grpc.aio.Channel
    stub: rollout_pb2_grpc.RolloutServiceStub
    rollout_id: str = ""
    version: int = -1
    in_flight: int = 0
    max_in_flight: int = 1
    healthy: bool = False
    syncing: bool = False
    tokens_generated: int = 0
    failures: int = field(default=0)

    def slot(self) -> RolloutSlot:
        usable = self.healthy and not self.syncing
        return RolloutSlot(
            self.rollout_id or self.address, self.in_flight, self.max_in_flight, self.version, usable
        )


class RolloutPool:
    """All known rollouts; `changed` is notified whenever credits, health or versions move."""

    def __init__(self, control_timeout: float) -> None:
        self._by_address: dict[str, RolloutHandle] = {}
        self._timeout = control_timeout
        self.changed = asyncio.Condition()

    def add(self, address: str) -> RolloutHandle:
        if address not in self._by_address:
            channel = open_channel(address)
            self._by_address[address] = RolloutHandle(
                address, channel, rollout_pb2_grpc.RolloutServiceStub(channel)
            )
        return self._by_address[address]

    def handles(self) -> list[RolloutHandle]:
        return list(self._by_address.values())

    def healthy(self) -> list[RolloutHandle]:
        return [h for h in self._by_address.values() if h.healthy]

    async def refresh(self, handle: RolloutHandle) -> None:
        """Poll one rollout's state; mark it unhealthy if it does not answer in time."""
        try:
            state = await handle.stub.GetRolloutState(
                rollout_pb2.GetRolloutStateRequest(), timeout=self._timeout
            )
        except grpc.aio.AioRpcError as exc:
            if handle.healthy:
                log.warning("rollout unreachable", address=handle.address, code=exc.code().name)
            await self.mark(handle, healthy=False)
            return
        ready = state.status in (rollout_pb2.ROLLOUT_STATUS_READY, rollout_pb2.ROLLOUT_STATUS_UPDATING)
        handle.rollout_id = state.rollout_id or handle.address
        handle.version = state.weight_version
        handle.max_in_flight = max(1, state.max_in_flight)
        handle.tokens_generated = state.tokens_generated
        if ready and not handle.healthy:
            log.info("rollout healthy", rollout=handle.rollout_id, version=handle.version)
        await self.mark(handle, healthy=ready)

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh(h) for h in self.handles()))

    async def mark(self, handle: RolloutHandle, *, healthy: bool) -> None:
        async with self.changed:
            handle.healthy = healthy
            self.changed.notify_all()

    async def acquire(self, train_version: Callable[[], int], max_staleness: int) -> RolloutHandle:
        """Wait for a rollout with a free credit whose weights are at most `max_staleness` versions
        older than `train_version()` (re-evaluated on every change), and take one credit on it."""
        async with self.changed:
            while True:
                slots = [h.slot() for h in self.handles()]
                chosen = pick_rollout(slots, train_version(), max_staleness)
                if chosen is not None:
                    handle = next(h for h in self.handles() if (h.rollout_id or h.address) == chosen)
                    handle.in_flight += 1
                    return handle
                await self.changed.wait()

    async def release(self, handle: RolloutHandle) -> None:
        async with self.changed:
            handle.in_flight -= 1
            self.changed.notify_all()

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def close(self) -> None:
        await asyncio.gather(*(h.channel.close() for h in self.handles()))
