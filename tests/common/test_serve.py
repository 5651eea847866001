"""The serve skeleton with a real in-process server: health, reflection, error mapping, shutdown.

The app is a minimal SchedulerService whose start() can be held open (readiness), and whose
handlers raise a domain error or an unexpected one. The process-level tests run
`tests/common/_serve_entry.py` (the real `run_service`) and signal that child by its pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.config import ServiceSettings
from services.common.errors import DataLoss, InvalidArgument
from services.common.serve import start_server

ROOT = Path(__file__).resolve().parents[2]
SCHEDULER = "grpo.scheduler.v1.SchedulerService"
LEARNER = "grpo.learner.v1.LearnerService"
HEALTH = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT = 10.0


class _Servicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.gate = asyncio.Event()  # GetStatus waits for it (set unless a test holds calls)
        self.gate.set()
        self.entered = asyncio.Event()

    async def GetStatus(self, request, context):
        self.entered.set()
        await self.gate.wait()
        return scheduler_pb2.GetStatusResponse(step=3)

    async def Pause(self, request, context):
        raise InvalidArgument("cannot pause: run not started")

    async def Resume(self, request, context):
        raise RuntimeError("boom")


class _Learner(learner_pb2_grpc.LearnerServiceServicer):
    async def FetchWeights(self, request, context):
        yield learner_pb2.FetchWeightsResponse(chunk=types_pb2.WeightChunk(version=request.version))
        raise DataLoss(f"weight bucket 0 of version {request.version} is corrupt")


class HeldApp:
    """Scheduler + Learner (FetchWeights only) app whose start() waits until the test releases it."""

    service_names = (SCHEDULER, LEARNER)

    def __init__(self, hold: bool = False) -> None:
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.stopped = False
        self.servicer = _Servicer()

    def register(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(self.servicer, server)
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(_Learner(), server)

    async def start(self) -> None:
        await self.release.wait()

    async def stop(self) -> None:
        self.stopped = True


def _settings(port: int = 0, **overrides) -> ServiceSettings:
    return ServiceSettings(port=port, grace_seconds=0.5, **overrides)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _health(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
    return response.status


async def test_liveness_serving_and_readiness_waits_for_start() -> None:
    app = HeldApp(hold=True)
    port = _free_port()
    starting = asyncio.create_task(start_server(app, _settings(port)))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), TIMEOUT)
        assert await _health(channel, "") == SERVING
        assert await _health(channel, SCHEDULER) == NOT_SERVING
        assert not starting.done()
        app.release.set()
        running = await asyncio.wait_for(starting, TIMEOUT)
        try:
            assert running.port == port
            assert await _health(channel, SCHEDULER) == SERVING
        finally:
            await running.close()
    assert app.stopped


@pytest.fixture
async def running():
    server = await start_server(HeldApp(), _settings())
    yield server
    await server.close()


async def test_reflection_lists_service_and_health(running) -> None:
    async with grpc.aio.insecure_channel(running.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        names = set()
        async for response in stub.ServerReflectionInfo(iter([request]), timeout=TIMEOUT):
            names |= {s.name for s in response.list_services_response.service}
    assert {SCHEDULER, HEALTH} <= names


async def test_domain_and_unexpected_errors_map_to_status_codes(running) -> None:
    async with grpc.aio.insecure_channel(running.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as invalid:
            await stub.Pause(scheduler_pb2.PauseRequest(), timeout=TIMEOUT)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert invalid.value.details() == "cannot pause: run not started"
        with pytest.raises(grpc.aio.AioRpcError) as internal:
            await stub.Resume(scheduler_pb2.ResumeRequest(), timeout=TIMEOUT)
        assert internal.value.code() == grpc.StatusCode.INTERNAL
        assert "RuntimeError: boom" in internal.value.details()
        # The server keeps serving after both failures.
        status = await stub.GetStatus(scheduler_pb2.GetStatusRequest(), timeout=TIMEOUT)
        assert status.step == 3
        unimplemented = stub.RegisterWorker(scheduler_pb2.RegisterWorkerRequest(), timeout=TIMEOUT)
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await unimplemented
        assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_domain_error_in_a_stream_arrives_after_the_items_sent(running) -> None:
    async with grpc.aio.insecure_channel(running.address) as channel:
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        call = stub.FetchWeights(learner_pb2.FetchWeightsRequest(version=4), timeout=TIMEOUT)
        assert (await call.read()).chunk.version == 4
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert err.value.details() == "weight bucket 0 of version 4 is corrupt"


async def test_concurrency_cap_answers_resource_exhausted() -> None:
    app = HeldApp()
    app.servicer.gate.clear()
    running = await start_server(app, _settings(max_concurrent_rpcs=1))
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            first = asyncio.ensure_future(stub.GetStatus(scheduler_pb2.GetStatusRequest(), timeout=TIMEOUT))
            await asyncio.wait_for(app.servicer.entered.wait(), TIMEOUT)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.GetStatus(scheduler_pb2.GetStatusRequest(), timeout=TIMEOUT)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            app.servicer.gate.set()
            assert (await first).step == 3
    finally:
        await running.close()


async def test_close_flips_readiness_to_not_serving() -> None:
    app = HeldApp()
    running = await start_server(app, _settings())
    async with grpc.aio.insecure_channel(running.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SCHEDULER), timeout=TIMEOUT
        )
        assert (await watch.read()).status == SERVING
        closing = asyncio.create_task(running.close())
        assert (await watch.read()).status == NOT_SERVING
        await asyncio.wait_for(closing, TIMEOUT)
        watch.cancel()
    assert app.stopped


@pytest.fixture
def service_process(tmp_path: Path):
    """The entry module as a child process; yields (process, port). Killed by pid if still alive."""
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    entry = str(ROOT / "tests/common/_serve_entry.py")
    process = subprocess.Popen(
        [sys.executable, entry, "--port", "0", "--port-file", str(port_file)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = _wait_for_port(process, port_file)
        yield process, port
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=TIMEOUT)


def _wait_for_port(process: subprocess.Popen, port_file: Path) -> int:
    """Poll the port file (written once ready); fail with the child's stderr if it exits first."""
    for _ in range(600):
        if port_file.exists():
            return int(port_file.read_text())
        if process.poll() is not None:
            pytest.fail(f"service exited with {process.returncode}: {process.stderr.read()}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=0.05)
    pytest.fail("service did not write its port file")


def test_process_health_grpcurl_and_graceful_sigterm(service_process) -> None:
    process, port = service_process
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", SCHEDULER):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
            assert response.status == SERVING, service
    grpcurl = str(ROOT / ".venv/bin/grpcurl")
    listed = subprocess.run(
        [grpcurl, "-plaintext", f"127.0.0.1:{port}", "list"], capture_output=True, text=True, timeout=30
    )
    assert listed.returncode == 0, listed.stderr
    assert {SCHEDULER, HEALTH} <= set(listed.stdout.split())
    described = subprocess.run(
        [grpcurl, "-plaintext", f"127.0.0.1:{port}", "describe", SCHEDULER],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert described.returncode == 0, described.stderr
    assert "rpc GetStatus" in described.stdout
    called = subprocess.run(
        [grpcurl, "-plaintext", f"127.0.0.1:{port}", f"{SCHEDULER}/GetStatus"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout)["step"] == "7"

    os.kill(process.pid, signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    events = [json.loads(line).get("event") for line in stderr.splitlines() if line.startswith("{")]
    assert events.index("draining") < events.index("stopped"), events


def test_sigterm_during_start_up_cancels_it_and_exits_cleanly() -> None:
    port = _free_port()
    entry = str(ROOT / "tests/common/_serve_entry.py")
    process = subprocess.Popen(
        [sys.executable, entry, "--port", str(port), "--hang-start"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
            stub = health_pb2_grpc.HealthStub(channel)
            assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT).status == SERVING
            readiness = stub.Check(health_pb2.HealthCheckRequest(service=SCHEDULER), timeout=TIMEOUT)
            assert readiness.status == NOT_SERVING  # start() is hanging
        os.kill(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stderr
        assert "signalled while starting" in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=TIMEOUT)
