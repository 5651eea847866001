"""A rollout registers itself with a scheduler (services/rollout/registration.py): real rollout server
(transformers engine, the tiny model) and a real gRPC server with the scheduler's own servicer, whose
orchestrator side records what it is told."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import pytest

from grpo.scheduler.v1 import scheduler_pb2_grpc
from services.common.serve import start_server
from services.rollout.config import RegistrationConfig
from services.rollout.registration import advertised_address
from services.rollout.server import RolloutApp
from services.scheduler.servicer import SchedulerServicer

from .test_rollout_grpc import settings_for


class _Orchestrator:
    """What SchedulerServicer.RegisterWorker calls: records the addresses."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.changed = asyncio.Event()

    def register_rollout(self, address: str) -> str:
        self.addresses.append(address)
        self.changed.set()
        return address

    async def wait_for(self, count: int, timeout: float = 30) -> None:  # noqa: ASYNC109
        async def enough() -> None:
            while len(self.addresses) < count:
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(enough(), timeout)


async def _scheduler(port: int, orchestrator: _Orchestrator) -> grpc.aio.Server:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(orchestrator), server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_advertised_address_defaults_to_this_host_and_the_bound_port() -> None:
    assert (
        advertised_address(RegistrationConfig(advertise_address="10.1.2.3:50052"), 1234) == "10.1.2.3:50052"
    )
    assert advertised_address(RegistrationConfig(), 50052) == f"{socket.gethostname()}:50052"
    with pytest.raises(ValueError, match="bound port"):
        advertised_address(RegistrationConfig(), None)


async def test_a_rollout_registers_at_start_again_every_interval_and_waits_out_a_missing_scheduler(
    tiny_model_dir: Path,
) -> None:
    port = _free_port()  # the scheduler is not there yet: the rollout must serve anyway and keep trying
    registration = {"scheduler_address": f"127.0.0.1:{port}", "interval_s": 0.2, "timeout_s": 2}
    settings = settings_for(tiny_model_dir, registration={**registration, "advertise_address": ""})
    running = await start_server(RolloutApp(settings), settings)
    scheduler = None
    try:
        app = running.app
        assert app.registration is not None and app.registration.registered == 0
        await asyncio.sleep(0.5)  # a few failed attempts, the rollout still SERVING
        assert app.registration.registered == 0
        orchestrator = _Orchestrator()
        scheduler = await _scheduler(port, orchestrator)
        await orchestrator.wait_for(2)  # registered, then again (a restarted scheduler relearns it)
        assert set(orchestrator.addresses) == {f"{socket.gethostname()}:{running.port}"}
    finally:
        await running.close()
        if scheduler is not None:
            await scheduler.stop(0)
    assert app.registration._task.done()  # stopped with the service


async def test_no_scheduler_address_means_no_registration(tiny_model_dir: Path) -> None:
    settings = settings_for(tiny_model_dir)
    running = await start_server(RolloutApp(settings), settings)
    try:
        assert running.app.registration is None
    finally:
        await running.close()
