"""Admission: may one more generation request go out now? (backpressure, before any rollout is asked)

The gateway asks its `Admission` before every generating call and tells it when the call ended. A
refusal becomes 429 with `Retry-After` (the refusal's seconds), never a queue. The standalone
implementation bounds the requests in flight through the gateway; a scheduler that drives episodes
through the gateway plugs in one backed by its staleness bound (refuse while the policy lag is full,
as AReaL's proxy does), with the same two methods.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Protocol

from grpo.common.v1 import types_pb2
from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.clients import GrpcClient
from services.common.errors import GrpoError
from services.common.logging import get_logger

log = get_logger(__name__)


class Admission(Protocol):
    """Decides whether a generating request may start now. Called on the event loop: never blocks."""

    def try_admit(self, session_id: str) -> int | None:
        """None: admitted (the gateway calls `release` once when it ends). Otherwise the seconds a
        client should wait before retrying (the 429's Retry-After). `session_id` is "" without one."""

    def release(self, session_id: str) -> None:
        """The admitted request ended (answered, failed or cancelled)."""


class InFlightAdmission:
    """Standalone: at most `max_in_flight` generating requests through the gateway at once."""

    def __init__(self, max_in_flight: int, retry_after_s: int) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    def try_admit(self, session_id: str) -> int | None:
        if self.in_flight >= self.max_in_flight:
            return self.retry_after_s
        self.in_flight += 1
        return None

    def release(self, session_id: str) -> None:
        self.in_flight -= 1


@dataclass(frozen=True)
class RunView:
    """What the scheduler said last: the learner's version and each rollout's."""

    learner_version: int
    rollout_versions: tuple[int, ...]
    paused: bool
    finished: bool


def staleness_full(view: RunView | None, max_staleness: int) -> str:
    """Why a training run cannot take more work now ("" = it can): no answer from the scheduler yet,
    the run paused or finished, or every rollout's weights more than `max_staleness` versions behind
    the learner (what they would sample now would be too old to train on)."""
    if view is None:
        return "the scheduler has not answered yet"
    if view.finished:
        return "the run is finished"
    if view.paused:
        return "the run is paused"
    oldest = view.learner_version - max_staleness
    if not any(version >= oldest for version in view.rollout_versions):
        return f"every rollout is more than {max_staleness} versions behind learner v{view.learner_version}"
    return ""


class SchedulerClient(GrpcClient[scheduler_pb2_grpc.SchedulerServiceStub]):
    def __init__(self, address: str, deadline_s: float) -> None:
        super().__init__(address, scheduler_pb2_grpc.SchedulerServiceStub)
        self.deadline_s = deadline_s

    async def status(self) -> scheduler_pb2.GetStatusResponse:
        return await self.unary("GetStatus", scheduler_pb2.GetStatusRequest(), self.deadline_s)

    async def view(self) -> RunView:
        s = await self.status()
        return RunView(s.learner_version, tuple(r.weight_version for r in s.rollouts), s.paused, s.finished)

    async def submit(
        self, groups: list[types_pb2.ScoredGroup], source: str, deadline_s: float
    ) -> scheduler_pb2.SubmitGroupsResponse:
        """SubmitGroups (the trajectory API's matched groups); answered once they are durable."""
        request = scheduler_pb2.SubmitGroupsRequest(groups=groups, source=source)
        return await self.unary("SubmitGroups", request, deadline_s)


class StalenessAdmission:
    """A training run's bound: the standalone in-flight bound, and 429 while the scheduler's run
    cannot take work fresh enough (`staleness_full`), read from its GetStatus every `interval_s`
    (a scheduler that stops answering closes admission: nothing is generated that nobody can train)."""

    def __init__(
        self, inner: InFlightAdmission, scheduler: SchedulerClient, max_staleness: int, interval_s: float
    ) -> None:
        self.inner, self.scheduler = inner, scheduler
        self.max_staleness, self.interval_s = max_staleness, interval_s
        self.view: RunView | None = None
        self.reason = "the scheduler has not answered yet"
        self._task: asyncio.Task[None] | None = None

    def try_admit(self, session_id: str) -> int | None:
        if self.reason:
            return max(1, round(self.interval_s))
        return self.inner.try_admit(session_id)

    def release(self, session_id: str) -> None:
        self.inner.release(session_id)

    async def poll_once(self) -> None:
        try:
            self.view = await self.scheduler.view()
        except GrpoError as exc:
            self.view = None
            log.warning("scheduler status unavailable: admission closed", error=str(exc))
        self.reason = staleness_full(self.view, self.max_staleness)

    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll_once()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.scheduler.close()
