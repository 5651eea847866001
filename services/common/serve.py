"""The one server skeleton every grpo-mesh service runs on.

    uvloop → grpc.aio server (explicit message limits, concurrency cap) → reflection + health →
    listen (+ event-loop lag monitor) → app.start() (load model, connect peers) → readiness SERVING →
    wait for SIGTERM/SIGINT → health NOT_SERVING → server.stop(grace) → app.stop() (tasks, channels).

Liveness (`service=""`) is SERVING as soon as the port answers; readiness (the full service name)
only after `app.start()` returns, and both drop to NOT_SERVING while draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import structlog
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.clients import grpc_options
from services.common.config import ServiceSettings
from services.common.cpus import apply_cpu_affinity
from services.common.errors import status_for
from services.common.logging import configure_logging, get_logger
from services.common.loop_lag import LoopLagMonitor

log = get_logger(__name__)


class ServiceApp(Protocol):
    """What a service provides to the skeleton. `server.py` of each service builds one."""

    service_names: tuple[str, ...]
    # The port the server actually bound (set by the skeleton before `start()`; matters with port 0).
    bound_port: int | None

    def register(self, server: grpc.aio.Server) -> None:
        """Add the servicer(s) to the server."""

    async def start(self) -> None:
        """Load models / connect to peers. The service is ready when this returns."""

    async def stop(self) -> None:
        """Cancel background tasks and close outbound channels."""


def service_names(*modules: Any) -> tuple[str, ...]:
    """Full names of the gRPC services defined in generated `_pb2` modules (from their DESCRIPTOR).

    `service_names(learner_pb2)` → ("grpo.learner.v1.LearnerService",): adapters, reflection and
    health checks take their names from the contract, never from a hand-written string.
    """
    return tuple(
        service.full_name for module in modules for service in module.DESCRIPTOR.services_by_name.values()
    )


class _ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Binds a request id per RPC and maps domain exceptions to status codes (errors.status_for)."""

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or not details.method.startswith("/grpo."):
            return handler
        metadata = dict(details.invocation_metadata or ())
        request_id = metadata.get("x-request-id") or uuid.uuid4().hex[:12]
        method = details.method

        def bind() -> None:
            structlog.contextvars.bind_contextvars(rpc=method, request_id=request_id)

        async def abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
            code, message = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("rpc failed", error=message)
            else:
                log.info("rpc rejected", code=code.name, error=message)
            await context.abort(code, message)

        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                bind()
                try:
                    return await inner(request, context)
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await abort(context, exc)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                bind()
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except (asyncio.CancelledError, grpc.aio.AbortError):
                    raise
                except Exception as exc:
                    await abort(context, exc)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


@dataclass
class RunningServer:
    """A started server: its bound port, health servicer and the app behind it."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    app: ServiceApp
    port: int
    grace_seconds: float
    loop_lag: LoopLagMonitor

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def set_ready(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self.app.service_names:
            await self.health.set(name, status)

    async def close(self) -> None:
        """Graceful stop: NOT_SERVING → server.stop(grace) → app.stop()."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.grace_seconds)
        await self.app.stop()
        await self.loop_lag.stop()


async def start_server(app: ServiceApp, settings: ServiceSettings) -> RunningServer:
    """Build, bind and start the server, then start the app and flip readiness to SERVING."""
    server = grpc.aio.server(
        interceptors=[_ErrorInterceptor()],
        options=grpc_options(settings.max_message_bytes),
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    app.register(server)
    reflection.enable_server_reflection(
        (*app.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    if port == 0:
        raise OSError(f"could not bind {settings.host}:{settings.port}")
    app.bound_port = port  # before start(): e.g. the learner advertises host:port for weight fetches
    loop_lag = LoopLagMonitor(report_every=settings.loop_lag_report_seconds)
    running = RunningServer(server, health_servicer, app, port, settings.grace_seconds, loop_lag)
    await running.set_ready(False)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    loop_lag.start()
    log.info("listening", port=port, services=list(app.service_names))
    started = time.perf_counter()
    try:
        await app.start()
    except BaseException:
        await running.close()
        raise
    await running.set_ready(True)
    log.info("ready", port=port, startup_s=round(time.perf_counter() - started, 2))
    return running


async def serve_until_signalled(app: ServiceApp, settings: ServiceSettings) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully.

    A signal during `app.start()` (e.g. a long model load) cancels the start; start_server then
    closes the server and calls app.stop(), and the process exits cleanly instead of waiting.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(start_server(app, settings))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        log.info("signalled while starting: cancelling start-up")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        log.info("stopped")
        return
    stopping.cancel()
    running = starting.result()
    if settings.port_file:
        # Atomic (write + rename): a launcher polling for the file never reads it half-written.
        tmp = settings.port_file.with_name(settings.port_file.name + ".tmp")
        tmp.write_text(str(running.port))
        tmp.replace(settings.port_file)
    try:
        await stop.wait()
    finally:
        log.info("draining", grace_s=settings.grace_seconds)
        await running.close()
        log.info("stopped")


def run_service(name: str, build_app: Callable[[], ServiceApp], settings: ServiceSettings) -> None:
    """Process entry point shared by `python -m services.<svc>`."""
    configure_logging(settings.log_level, service=name)
    apply_cpu_affinity(settings.cpus)
    if settings.nice:
        os.nice(settings.nice)  # inherited by every process this service starts (vLLM's engine and workers)
    uvloop.run(serve_until_signalled(build_app(), settings))
