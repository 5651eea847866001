"""Outbound gRPC: channel options shared with the servers, and the base every client is built on.

`GrpcClient` owns one channel to one peer, opened lazily on first use (grpc.aio channels must be
created inside the running event loop, while clients are often constructed before it starts),
puts a deadline on every call, and turns failed calls into domain errors through the one
client-side table (`errors.from_rpc_error`), so no caller handles raw status codes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

import grpc

from services.common.config import CONTROL_MESSAGE_BYTES
from services.common.errors import DeadlineExceeded, from_rpc_error

StubT = TypeVar("StubT")


def grpc_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel/server options, identical on both sides: explicit size limits and keepalive."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # server: accept our 30 s pings
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.so_reuseport", 0),
        # a peer that restarts (a supervisor brings it back on its port) is found again within ~5 s,
        # not after gRPC's default reconnect back-off of up to 120 s
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", 5_000),
    ]


def open_channel(address: str, max_message_bytes: int = CONTROL_MESSAGE_BYTES) -> grpc.aio.Channel:
    """An insecure channel to `address` (host:port). Create it inside the running event loop."""
    return grpc.aio.insecure_channel(address, options=grpc_options(max_message_bytes))


async def wait_ready(channel: grpc.aio.Channel, timeout: float) -> None:  # noqa: ASYNC109 (the caller's deadline)
    """Wait until the channel connects (no sleeps), or raise TimeoutError."""
    await asyncio.wait_for(channel.channel_ready(), timeout)


class GrpcClient(Generic[StubT]):
    """One peer: a lazily opened channel, a stub, deadlines and domain errors on every call."""

    def __init__(
        self, address: str, stub_class: type[StubT], max_message_bytes: int = CONTROL_MESSAGE_BYTES
    ) -> None:
        self.address = address
        self._stub_class = stub_class
        self._max_message_bytes = max_message_bytes
        self._channel: grpc.aio.Channel | None = None
        self._stub: StubT | None = None

    @property
    def peer(self) -> str:
        """How errors name this peer (subclasses prefix the service, e.g. "rollout 10.0.0.2:50052")."""
        return self.address

    @property
    def stub(self) -> StubT:
        if self._stub is None:
            self._channel = open_channel(self.address, self._max_message_bytes)
            self._stub = self._stub_class(self._channel)
        return self._stub

    async def wait_ready(self, timeout: float) -> None:  # noqa: ASYNC109 (a connect deadline)
        """Wait until the peer accepts connections, or raise DeadlineExceeded."""
        _ = self.stub
        assert self._channel is not None
        try:
            await wait_ready(self._channel, timeout)
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{self.peer}: not reachable within {timeout:g}s") from exc

    async def unary(self, method: str, request: Any, timeout: float) -> Any:  # noqa: ASYNC109
        """Call a unary RPC with a deadline; a failure raises the mapped domain error."""
        try:
            return await getattr(self.stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, self.peer) from exc

    async def stream(self, method: str, request: Any, timeout: float) -> AsyncIterator[Any]:  # noqa: ASYNC109
        """Iterate a server-streaming RPC under one deadline; a failure raises the mapped domain error."""
        call = getattr(self.stub, method)(request, timeout=timeout)
        try:
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, self.peer) from exc
        finally:
            call.cancel()  # no-op when finished; frees the stream if the caller stopped early

    async def close(self) -> None:
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()
