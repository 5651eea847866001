"""`GrpcRolloutClient.generate` over GenerateBatch: the groups sent to one rollout at about the same
time travel in one call.

The orchestrator asks for one group at a time (`RolloutClient.generate`), and a gRPC call costs a
few hundred microseconds of CPU at each end whatever it carries: with short completions that was
most of what the Rollout service added to bare vLLM (docs/performance.md). So a group's request
waits up to `window_ms` for others to the same rollout, then all of them (at most `max_requests`)
go out as one GenerateBatch; its stream's results are routed to each group by request id, and a
group is answered as soon as its `n` completions are in, not when the call ends.

What a group sees is what one Generate call of its own gave: its completions, or the domain error
its request failed with (a request's `RequestError` goes through the same client-side table as a
failed call's status), or the call's error when the whole call fails (the rollout died: each of its
groups is retried by the orchestrator as before). The call's deadline is the `generate` timeout.
A group whose caller is cancelled before the call goes out is never sent; once sent, its request
runs on with the others (the call is cancelled when none of its groups is waited for any more).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from prometheus_client import Histogram

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2
from services.common.clients import GrpcClient
from services.common.errors import Cancelled, InvalidArgument, from_status
from services.scheduler.peers.config import GenerateBatchSettings

GENERATE_BATCH_GROUPS = Histogram(
    "grpo_scheduler_generate_batch_groups",
    "Groups per GenerateBatch call to a rollout (those issued within the window).",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)


@dataclass(eq=False)
class _Group:
    """One group's request, its completions so far, and the future its caller waits on."""

    request: rollout_pb2.GenerateRequest
    n: int
    future: asyncio.Future[list[types_pb2.Completion]]
    completions: list[types_pb2.Completion] = field(default_factory=list)
    call: asyncio.Task[None] | None = None  # the GenerateBatch call it went out in

    def resolve(self, error: BaseException | None = None) -> None:
        if self.future.done():
            return
        if error is None:
            self.future.set_result(self.completions)
        else:
            self.future.set_exception(error)


class GenerateBatcher:
    """Coalesces one peer's `generate` calls into GenerateBatch calls (one batcher per client)."""

    def __init__(self, client: GrpcClient, timeout: float, settings: GenerateBatchSettings) -> None:
        self._client = client
        self._timeout = timeout
        self._window_s = settings.window_ms / 1000.0
        self._max_requests = settings.max_requests
        self._pending: dict[str, _Group] = {}  # waiting for the window to close
        self._flush_handle: asyncio.Handle | None = None
        self._calls: dict[asyncio.Task[None], dict[str, _Group]] = {}  # calls in flight and their groups
        # GenerateBatch calls made and stream messages received (benchmarks read them; operators have
        # the groups per call as grpo_scheduler_generate_batch_groups)
        self.calls = 0
        self.messages = 0

    async def generate(self, request: rollout_pb2.GenerateRequest, n: int) -> list[types_pb2.Completion]:
        """The request's completions (all `n` unless the rollout sent fewer), or its domain error."""
        request_id = request.request_id
        if request_id in self._pending or any(
            request_id in groups and not groups[request_id].future.done() for groups in self._calls.values()
        ):
            raise InvalidArgument(f"{self._client.peer}: request_id {request_id!r} is already in flight")
        loop = asyncio.get_running_loop()
        group = _Group(request, n, loop.create_future())
        self._pending[request_id] = group
        if len(self._pending) >= self._max_requests:
            self._flush()
        elif self._flush_handle is None and self._window_s > 0:
            self._flush_handle = loop.call_later(self._window_s, self._flush)
        elif self._flush_handle is None:
            self._flush_handle = loop.call_soon(self._flush)
        try:
            return await group.future
        finally:
            if group.future.cancelled():
                self._abandon(group)

    def _abandon(self, group: _Group) -> None:
        """The caller stopped waiting: drop an unsent request; cancel a call nobody waits on any more."""
        request_id = group.request.request_id
        if self._pending.get(request_id) is group:
            del self._pending[request_id]
        elif group.call in self._calls and all(g.future.done() for g in self._calls[group.call].values()):
            group.call.cancel()

    def _flush(self) -> None:
        """Send everything pending, `max_requests` groups per call."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        while self._pending:
            ids = list(self._pending)[: self._max_requests]
            groups = {request_id: self._pending.pop(request_id) for request_id in ids}
            call = asyncio.create_task(self._call(groups), name=f"generate-batch {self._client.peer}")
            for group in groups.values():
                group.call = call
            self._calls[call] = groups
            call.add_done_callback(self._forget)

    def _forget(self, call: asyncio.Task[None]) -> None:
        del self._calls[call]

    async def _call(self, groups: dict[str, _Group]) -> None:
        request = rollout_pb2.GenerateBatchRequest(requests=[g.request for g in groups.values()])
        peer = self._client.peer
        error: BaseException | None = None
        self.calls += 1
        GENERATE_BATCH_GROUPS.observe(len(groups))
        try:
            async for response in self._client.stream("GenerateBatch", request, self._timeout):
                self.messages += 1
                for result in response.results:
                    group = groups.get(result.request_id)
                    if group is None or group.future.done():
                        continue  # not ours (a broken rollout), or its caller stopped waiting
                    if result.HasField("error"):
                        group.resolve(from_status(result.error.code, result.error.message, peer))
                        continue
                    group.completions.extend(result.completions)
                    if len(group.completions) >= group.n:
                        group.resolve()
        except asyncio.CancelledError:
            error = Cancelled(f"{peer}: the GenerateBatch call was cancelled (the client is closing)")
            raise
        except Exception as exc:  # a GrpoError (the call failed), or an answer that could not be read
            error = exc
        finally:
            for group in groups.values():  # the stream ended: the rest get what they have, or its error
                group.resolve(error)

    async def close(self) -> None:
        """Cancel the calls in flight (their groups' callers get `Cancelled`)."""
        for call in list(self._calls):
            call.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
