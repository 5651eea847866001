"""The rollouts behind the gateway, reached only over their gRPC API (grpo.rollout.v1).

`RolloutClient` is one rollout: GetRolloutState, RenderMessages and Generate, each with its
deadline, failures raised as the domain errors of `services.common.errors` (through `GrpcClient`,
which also gives every channel this process's TLS and bearer token, as the scheduler's clients).
`RolloutPool` keeps what the gateway knows of each (ready, max_model_len, the requests it has in
flight there), polls their state in the background, and picks where a request goes: the session's
rollout while it is usable, else the least loaded usable one; none with a free slot = 429.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import GrpcClient
from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.gateway.config import GatewayTimeouts
from services.gateway.errors import ApiError, too_many

log = get_logger(__name__)


class RolloutClient(GrpcClient[rollout_pb2_grpc.RolloutServiceStub]):
    """One rollout worker's gRPC API, with the gateway's deadlines."""

    def __init__(self, address: str, timeouts: GatewayTimeouts, max_message_bytes: int) -> None:
        super().__init__(address, rollout_pb2_grpc.RolloutServiceStub, max_message_bytes)
        self._timeouts = timeouts

    @property
    def peer(self) -> str:
        return f"rollout {self.address}"

    async def state(self) -> rollout_pb2.GetRolloutStateResponse:
        request = rollout_pb2.GetRolloutStateRequest()
        return await self.unary("GetRolloutState", request, self._timeouts.health_s)

    async def render(self, request: rollout_pb2.RenderMessagesRequest) -> rollout_pb2.RenderMessagesResponse:
        return await self.unary("RenderMessages", request, self._timeouts.control_s)

    async def generate(self, request: rollout_pb2.GenerateRequest) -> list[types_pb2.Completion]:
        """All n completions of one request, ordered by index."""
        completions = [
            completion
            async for response in self.stream("Generate", request, self._timeouts.generate_s)
            for completion in response.completions
        ]
        return sorted(completions, key=lambda c: c.index)


@dataclass
class RolloutView:
    """What the gateway knows of one rollout."""

    client: RolloutClient
    ready: bool = False
    max_model_len: int = 0
    model: str = ""
    rollout_id: str = ""
    weight_version: int = 0
    in_flight: int = 0

    @property
    def address(self) -> str:
        return self.client.address


class RolloutPool:
    """Routing, in-flight counting and health of the rollouts (one event loop, no locks needed)."""

    def __init__(
        self, clients: Sequence[RolloutClient], per_rollout_in_flight: int, retry_after_s: int, poll_s: float
    ) -> None:
        self.views = {client.address: RolloutView(client) for client in clients}
        self._bound = per_rollout_in_flight
        self._retry_after_s = retry_after_s
        self._poll_s = poll_s
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        self._poller = asyncio.create_task(self._poll(), name="gateway-rollout-poll")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await asyncio.gather(*(view.client.close() for view in self.views.values()))

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            await self.refresh()

    async def refresh(self) -> bool:
        """Ask every rollout for its state (concurrently, each under the health deadline); True when
        at least one is READY."""
        await asyncio.gather(*(self._refresh_one(view) for view in self.views.values()))
        return any(view.ready for view in self.views.values())

    async def _refresh_one(self, view: RolloutView) -> None:
        try:
            state = await view.client.state()
        except GrpoError as exc:
            if view.ready:
                log.warning("rollout unreachable", rollout=view.address, error=str(exc))
            view.ready = False
            return
        view.ready = state.status == rollout_pb2.ROLLOUT_STATUS_READY
        view.max_model_len = state.max_model_len or view.max_model_len
        view.model = state.model
        view.rollout_id = state.rollout_id
        view.weight_version = state.weight_version

    def mark_failed(self, view: RolloutView, exc: GrpoError) -> None:
        """A call found the rollout unreachable: route around it until a poll finds it READY again."""
        if exc.unreachable and view.ready:
            log.warning("rollout marked unusable", rollout=view.address, error=str(exc))
            view.ready = False

    def max_model_len(self) -> int:
        """The smallest context length among the ready rollouts (0 = none known yet)."""
        lengths = [v.max_model_len for v in self.views.values() if v.ready and v.max_model_len]
        return min(lengths, default=0)

    def pick(self, sticky: str | None) -> RolloutView:
        """The session's rollout when it is usable, else the least loaded ready one with a free slot.
        None ready: 503; all full (or the session's rollout full): 429 with Retry-After."""
        if sticky is not None:
            view = self.views.get(sticky)
            if view is not None and view.ready:
                if view.in_flight >= self._bound:
                    raise too_many(
                        f"the session's rollout has {view.in_flight} requests in flight (the gateway's "
                        f"bound is {self._bound}); retry later",
                        self._retry_after_s,
                    )
                return view
        ready = [view for view in self.views.values() if view.ready]
        if not ready:
            raise ApiError(
                503, "no rollout is ready", None, "service_unavailable", "no_rollout",
                headers={"Retry-After": str(self._retry_after_s)},
            )  # fmt: skip
        view = min(ready, key=lambda v: v.in_flight)
        if view.in_flight >= self._bound:
            raise too_many(
                f"every ready rollout has {self._bound} requests in flight (the gateway bound); retry later",
                self._retry_after_s,
            )
        return view

    @contextlib.contextmanager
    def busy(self, view: RolloutView) -> Iterator[None]:
        """Counts one request in flight at `view` for the duration."""
        view.in_flight += 1
        try:
            yield
        finally:
            view.in_flight -= 1
