"""The one server skeleton every grpo-mesh service runs on.

    uvloop → grpc.aio server (explicit message limits, concurrency cap, the one interceptor:
    token check, decoding, error mapping, RPC metrics) → reflection + health → listen, TLS when
    configured (+ event-loop lag monitor, /metrics: 127.0.0.1 under security unless told
    otherwise, HTTPS and a credential when configured) → app.start() (load model, connect peers) →
    readiness SERVING → wait for SIGTERM/SIGINT → health NOT_SERVING → server.stop(grace) →
    app.stop() (tasks, channels).

Liveness (`service=""`) is SERVING as soon as the port answers; readiness (the full service name)
only after `app.start()` returns, and both drop to NOT_SERVING while draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import uvloop
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.clients import grpc_options
from services.common.config import ServiceSettings
from services.common.cpus import apply_cpu_affinity
from services.common.interceptor import ServiceInterceptor
from services.common.logging import configure_logging, get_logger
from services.common.loop_lag import LoopLagMonitor
from services.common.security import ClientSecurity, TokenCheck, server_credentials, set_client_security
from services.common.telemetry import (
    LOOP_LAG,
    READY,
    AppCollector,
    MetricsServer,
    RpcMetrics,
    check_metrics,
    register_app,
    start_metrics,
    unregister,
)

log = get_logger(__name__)


class ServiceApp(Protocol):
    """What a service provides to the skeleton. `server.py` of each service builds one.

    An app may also have a `fatal` attribute: when it is non-empty once the service stopped (the app
    signalled itself, unable to serve on), the process exits 1 with it, so a supervisor starts a fresh
    one."""

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


@dataclass
class RunningServer:
    """A started server: its bound port, health servicer and the app behind it."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    app: ServiceApp
    port: int
    grace_seconds: float
    loop_lag: LoopLagMonitor
    metrics: MetricsServer | None = None
    collector: AppCollector | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics is None else self.metrics.port

    async def set_ready(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self.app.service_names:
            await self.health.set(name, status)
        READY.set(1 if ready else 0)

    async def close(self) -> None:
        """Graceful stop: NOT_SERVING → server.stop(grace) → app.stop()."""
        await self.health.enter_graceful_shutdown()
        READY.set(0)
        await self.server.stop(self.grace_seconds)
        await self.app.stop()
        await self.loop_lag.stop()
        unregister(self.collector)
        if self.metrics is not None:
            await asyncio.to_thread(self.metrics.close)


async def start_server(app: ServiceApp, settings: ServiceSettings) -> RunningServer:
    """Build, bind and start the server, then start the app and flip readiness to SERVING."""
    tokens = TokenCheck(settings.security.token())
    server = grpc.aio.server(
        interceptors=[ServiceInterceptor(tokens, RpcMetrics())],
        options=grpc_options(settings.max_message_bytes),
        maximum_concurrent_rpcs=settings.max_concurrent_rpcs,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    app.register(server)
    reflection.enable_server_reflection(
        (*app.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    address = f"{settings.host}:{settings.port}"
    credentials = server_credentials(settings.security)
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    if port == 0:
        raise OSError(f"could not bind {address}")
    app.bound_port = port  # before start(): e.g. the learner advertises host:port for weight fetches
    loop_lag = LoopLagMonitor(report_every=settings.loop_lag_report_seconds, observe=LOOP_LAG.observe)
    running = RunningServer(server, health_servicer, app, port, settings.grace_seconds, loop_lag)
    try:  # off the loop: reads certificate files, binds, resolves the host
        running.metrics = await asyncio.to_thread(
            start_metrics, settings.telemetry, settings.security, settings.host
        )
    except BaseException:
        await server.stop(None)  # bound, never started: free the port
        raise
    await running.set_ready(False)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    loop_lag.start()
    if running.metrics is not None:
        running.collector = register_app(app)
    log.info(
        "listening",
        port=port,
        services=list(app.service_names),
        tls=credentials is not None,
        mutual_tls=settings.security.require_client_cert,
        token=tokens.enabled,
        metrics_port=running.metrics_port,
        metrics_host=None if running.metrics is None else running.metrics.host,
        metrics_tls=running.metrics is not None and running.metrics.tls,
        metrics_auth=settings.telemetry.metrics_auth,
    )
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
    if fatal := getattr(app, "fatal", ""):
        log.error("exiting 1", why=fatal)
        raise SystemExit(1)


def run_service(name: str, build_app: Callable[[], ServiceApp], settings: ServiceSettings) -> None:
    """Process entry point shared by `python -m services.<svc>`."""
    configure_logging(settings.log_level, service=name)
    try:  # what cannot be served (an unreadable token file, /metrics TLS without a certificate)
        check_metrics(settings.telemetry, settings.security)
    except ValueError as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if settings.security.token() and not settings.security.tls:
        log.warning("a bearer token without TLS travels in clear text: configure --security.tls-cert")
    set_client_security(ClientSecurity.from_settings(settings.security))  # every channel this process opens
    apply_cpu_affinity(settings.cpus)
    if settings.nice:
        os.nice(settings.nice)  # inherited by every process this service starts (vLLM's engine and workers)
    uvloop.run(serve_until_signalled(build_app(), settings))
