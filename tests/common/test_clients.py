"""services/common/clients.py: channels with the servers' options, and a bounded wait for readiness."""

from __future__ import annotations

import socket

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.clients import open_channel, wait_ready
from services.common.config import ServiceSettings
from services.common.serve import start_server


class _EmptyApp:
    service_names = ("grpo.test.v1.Nothing",)

    def register(self, server) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


async def test_open_channel_reaches_a_live_server() -> None:
    running = await start_server(_EmptyApp(), ServiceSettings(port=0, grace_seconds=0.1))
    try:
        async with open_channel(running.address) as channel:
            await wait_ready(channel, timeout=10)
            stub = health_pb2_grpc.HealthStub(channel)
            response = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await running.close()


async def test_wait_ready_gives_up_on_a_dead_address() -> None:
    with socket.socket() as sock:  # a port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    async with open_channel(address) as channel:
        with pytest.raises(TimeoutError):
            await wait_ready(channel, timeout=0.3)
