"""Gateway wiring: settings → rollout clients, pool, admission, recorder → `Gateway` → FastAPI → uvicorn.

    python -m services.gateway --rollouts 127.0.0.1:50052 --port 8000

uvicorn serves HTTP (HTTPS with `--security.tls-cert/key`; client certificates from
`--security.tls-ca` under `--security.require-client-cert`), handles SIGTERM/SIGINT gracefully
(stops accepting, gives requests in flight `--grace-seconds`), and runs the app's lifespan: start =
poll the rollouts once and keep polling, stop = close the channels and flush the call record.
Prometheus metrics (`--telemetry.metrics-port`) come from telemetry.py like every service's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
import uvloop

from services.common.cpus import apply_cpu_affinity
from services.common.logging import configure_logging, get_logger
from services.common.loop_lag import LoopLagMonitor
from services.common.security import ClientSecurity, set_client_security
from services.common.sockets import bind
from services.common.telemetry import (
    LOOP_LAG,
    Reading,
    check_metrics,
    register_app,
    start_metrics,
    unregister,
)
from services.gateway.admission import Admission, InFlightAdmission, SchedulerClient, StalenessAdmission
from services.gateway.config import GatewaySettings
from services.gateway.gateway import Gateway
from services.gateway.recorder import CallRecorder, JsonlRecorder, NullRecorder
from services.gateway.rollouts import RolloutClient, RolloutPool
from services.gateway.routes import build_app
from services.gateway.trajectories import Trajectories, add_routes

log = get_logger(__name__)


class GatewayApp:
    """The gateway and its parts, built from settings (an `Admission` or `CallRecorder` may be given:
    a scheduler's ledger-backed ones)."""

    def __init__(
        self,
        settings: GatewaySettings,
        admission: Admission | None = None,
        recorder: CallRecorder | None = None,
    ) -> None:
        self.settings = settings
        timeouts = settings.timeouts
        clients = [RolloutClient(a, timeouts, settings.max_message_bytes) for a in settings.rollouts]
        bound = settings.admission.per_rollout_in_flight
        retry = settings.admission.retry_after_s
        self.pool = RolloutPool(clients, bound, retry, timeouts.health_interval_s)
        if admission is None:
            admission = InFlightAdmission(bound * len(clients), retry)
            run = settings.admission
            if run.scheduler is not None:  # a training run's staleness bound as well
                scheduler = SchedulerClient(run.scheduler, timeouts.control_s)
                admission = StalenessAdmission(admission, scheduler, run.max_staleness, run.poll_interval_s)
        if recorder is None:
            path = settings.record.path
            recorder = NullRecorder() if path is None else JsonlRecorder(path, settings.record.max_pending)
        self.gateway = Gateway(settings, self.pool, admission, recorder)
        self.http = build_app(self.gateway, settings.security.token(), lifespan=self._lifespan)
        self.trajectories: Trajectories | None = None
        run = settings.trajectories
        if run.scheduler is not None:  # atropos' trajectory API in front of an external-source run
            scheduler = SchedulerClient(run.scheduler, timeouts.control_s)
            self.trajectories = Trajectories(run, self.gateway.registry, scheduler)
            add_routes(self.http, self.trajectories, settings.limits.max_body_bytes)
            self.gateway.metric_sources.append(self.trajectories.metrics)
        self._metrics: Any = None
        self._loop_lag = LoopLagMonitor(
            report_every=settings.loop_lag_report_seconds, observe=LOOP_LAG.observe
        )
        self._collector: Any = None

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        await self.pool.start()
        if isinstance(self.gateway.admission, StalenessAdmission):
            await self.gateway.admission.start()
        if self.trajectories is not None:
            await self.trajectories.start()
        self._loop_lag.start()
        self._metrics = await asyncio.to_thread(
            start_metrics, self.settings.telemetry, self.settings.security, self.settings.host
        )
        if self._metrics is not None:
            self._collector = register_app(self)
        log.info(
            "gateway ready",
            rollouts=self.settings.rollouts,
            ready=self.gateway.metrics()["gateway/rollouts_ready"],
        )
        try:
            yield
        finally:
            unregister(self._collector)
            if self._metrics is not None:
                await asyncio.to_thread(self._metrics.close)
            await self._loop_lag.stop()
            await self.pool.stop()
            if isinstance(self.gateway.admission, StalenessAdmission):
                await self.gateway.admission.stop()
            if self.trajectories is not None:
                await self.trajectories.stop()
            await self.gateway.recorder.close()
            log.info("gateway stopped")

    def metrics_snapshot(self) -> list[Reading]:
        """Prometheus view: the JSON /metrics values as gauges named grpo_gateway_<name>."""
        return [
            Reading(
                f"grpo_gateway_{key.replace('/', '_')}", f"gateway metric {key} (see docs/gateway.md)", value
            )
            for key, value in self.gateway.metrics().items()
        ]


def uvicorn_config(app: GatewayApp) -> uvicorn.Config:
    settings = app.settings
    security = settings.security
    tls: dict[str, Any] = {}
    if security.tls_cert is not None:
        tls = {"ssl_certfile": str(security.tls_cert), "ssl_keyfile": str(security.tls_key)}
        if security.require_client_cert:
            tls |= {"ssl_ca_certs": str(security.tls_ca), "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return uvicorn.Config(
        app.http,
        host=settings.host,
        port=settings.port,
        loop="none",  # the caller's loop (uvloop in main)
        lifespan="on",
        log_config=None,
        access_log=False,
        limit_concurrency=settings.max_concurrent_rpcs,
        timeout_keep_alive=int(max(1, settings.keep_alive_s)),
        timeout_graceful_shutdown=int(max(1, settings.grace_seconds)),
        **tls,
    )


class RunningGateway:
    """A gateway serving in this event loop (tests, benchmarks, `main`)."""

    def __init__(self, app: GatewayApp) -> None:
        self.app = app
        self.socket = bind(app.settings.host, app.settings.port)
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app))
        self.task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.app.settings.security.tls_cert else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]))
        while not self.server.started:
            if self.task.done():
                await self.task
                raise RuntimeError("the gateway did not start")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.socket.close()


async def serve(settings: GatewaySettings) -> None:
    running = RunningGateway(GatewayApp(settings))
    await running.start()
    log.info("listening", port=running.port, tls=settings.security.tls_cert is not None,
             token=bool(settings.security.token()))  # fmt: skip
    if settings.port_file:
        tmp = settings.port_file.with_name(settings.port_file.name + ".tmp")
        tmp.write_text(str(running.port))
        tmp.replace(settings.port_file)
    assert running.task is not None
    await running.task  # until SIGTERM/SIGINT (uvicorn's handlers): drain, lifespan stop
    running.socket.close()


def main(argv: list[str] | None = None, prog: str = "python -m services.gateway") -> None:
    settings = GatewaySettings.from_cli(argv, prog=prog)
    configure_logging(settings.log_level, service="gateway")
    try:
        check_metrics(settings.telemetry, settings.security)
    except ValueError as exc:
        print(f"gateway: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if settings.security.token() and not settings.security.tls:
        log.warning("a bearer token without TLS travels in clear text: configure --security.tls-cert")
    set_client_security(ClientSecurity.from_settings(settings.security))  # the channels to the rollouts
    apply_cpu_affinity(settings.cpus)
    if settings.nice:
        os.nice(settings.nice)
    uvloop.run(serve(settings))
