"""Outbound gRPC channels with the same options as the servers; every call site passes a deadline."""

from __future__ import annotations

import asyncio

import grpc

from services.common.config import CONTROL_MESSAGE_BYTES
from services.common.serve import grpc_options


def open_channel(address: str, max_message_bytes: int = CONTROL_MESSAGE_BYTES) -> grpc.aio.Channel:
    """An insecure channel to `address` (host:port). Create it inside the running event loop."""
    return grpc.aio.insecure_channel(address, options=grpc_options(max_message_bytes))


async def wait_ready(channel: grpc.aio.Channel, timeout: float) -> None:  # noqa: ASYNC109 (the caller's deadline)
    """Wait until the channel connects (no sleeps), or raise TimeoutError."""
    await asyncio.wait_for(channel.channel_ready(), timeout)
