"""Outbound gRPC: channel options shared with the servers, and the base every client is built on.

`GrpcClient` owns one channel to one peer, opened lazily on first use (grpc.aio channels must be
created inside the running event loop, while clients are often constructed before it starts),
puts a deadline on every call, and turns failed calls into domain errors through the one
client-side table (`errors.from_rpc_error`), so no caller handles raw status codes. Every channel
uses the process's `ClientSecurity` (security.py: TLS, client certificate, bearer token) unless
given another, so a service configured once reaches all its peers the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

import grpc

from services.common.config import CONTROL_MESSAGE_BYTES
from services.common.errors import DeadlineExceeded, from_rpc_error
from services.common.security import ClientSecurity, client_security

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


def _with_token(details: grpc.aio.ClientCallDetails, metadata: tuple) -> grpc.aio.ClientCallDetails:
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), *metadata))


class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds `authorization: Bearer <token>` to every unary call (also on a plaintext channel, where
    gRPC's call credentials would refuse to send it; serve.py warns about that set-up)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._metadata), request)


class _StreamToken(grpc.aio.UnaryStreamClientInterceptor):
    """The same for server-streaming calls (grpc.aio files an interceptor under one kind only)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(_with_token(details, self._metadata), request)


def open_channel(
    address: str, max_message_bytes: int = CONTROL_MESSAGE_BYTES, security: ClientSecurity | None = None
) -> grpc.aio.Channel:
    """A channel to `address` (host:port) with this process's security (TLS and token) unless
    `security` is given. Create it inside the running event loop."""
    security = client_security() if security is None else security
    options = grpc_options(max_message_bytes)
    if security.server_name:
        options.append(("grpc.ssl_target_name_override", security.server_name))
    metadata = security.metadata()
    interceptors = [_UnaryToken(metadata), _StreamToken(metadata)] if metadata else None
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


async def wait_ready(channel: grpc.aio.Channel, timeout: float) -> None:  # noqa: ASYNC109 (the caller's deadline)
    """Wait until the channel connects (no sleeps), or raise TimeoutError."""
    await asyncio.wait_for(channel.channel_ready(), timeout)


class GrpcClient(Generic[StubT]):
    """One peer: a lazily opened channel, a stub, deadlines and domain errors on every call."""

    def __init__(
        self,
        address: str,
        stub_class: type[StubT],
        max_message_bytes: int = CONTROL_MESSAGE_BYTES,
        security: ClientSecurity | None = None,
    ) -> None:
        self.address = address
        self._stub_class = stub_class
        self._max_message_bytes = max_message_bytes
        self._security = security
        self._channel: grpc.aio.Channel | None = None
        self._stub: StubT | None = None

    @property
    def peer(self) -> str:
        """How errors name this peer (subclasses prefix the service, e.g. "rollout 10.0.0.2:50052")."""
        return self.address

    @property
    def stub(self) -> StubT:
        if self._stub is None:
            self._channel = open_channel(self.address, self._max_message_bytes, self._security)
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

    async def stream(
        self,
        method: str,
        request: Any,
        timeout: float,  # noqa: ASYNC109 (the call's deadline)
        raw: bool = False,
    ) -> AsyncIterator[Any]:
        """Iterate a server-streaming RPC under one deadline; a failure raises the mapped domain error.
        `raw`: `method` is the full path ("/package.Service/Method") and the responses are their wire
        bytes, for a caller that parses them itself (the weight stream's zero-copy decoder)."""
        if raw:
            _ = self.stub
            assert self._channel is not None
            multicallable = self._channel.unary_stream(method, type(request).SerializeToString)
            call = multicallable(request, timeout=timeout)
        else:
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
