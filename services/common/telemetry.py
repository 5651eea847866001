"""Prometheus metrics of a service process, served over HTTP at `/metrics` (prometheus-client).

Every service exports the same base set (the interceptor and the skeleton fill them):

| name                        | type      | labels                | what                               |
|-----------------------------|-----------|-----------------------|------------------------------------|
| grpo_rpc_total              | counter   | service, method, code | RPCs answered, by status code      |
| grpo_rpc_seconds            | histogram | service, method       | RPC latency (call to status)       |
| grpo_event_loop_lag_seconds | histogram |                       | asyncio wake-up delay (100 ms probe) |
| grpo_service_ready          | gauge     |                       | 1 once readiness is SERVING        |

plus prometheus-client's `process_*` and `python_*` collectors, and each service's own metrics,
defined next to the code that moves them (`services/<svc>/telemetry.py`, listed in
docs/operations.md). Updating a metric is a few dictionary operations under a lock: cheap enough
for the event loop; the HTTP server runs on prometheus-client's own thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import prometheus_client
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

# Latency buckets from 1 ms (a status poll) to 10 min (a long train step or weight fetch).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180, 600)

RPC_TOTAL = Counter("grpo_rpc", "RPCs answered, by method and status code.", ["service", "method", "code"])
RPC_SECONDS = Histogram(
    "grpo_rpc_seconds", "RPC latency in seconds, by method.", ["service", "method"], buckets=LATENCY_BUCKETS
)
LOOP_LAG = Histogram(
    "grpo_event_loop_lag_seconds",
    "Event-loop wake-up delay beyond the probe's 100 ms sleep (blocking work on the loop shows here).",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
READY = Gauge("grpo_service_ready", "1 once readiness is SERVING, 0 while starting or draining.")


class TelemetrySettings(BaseModel):
    """`--telemetry.*`: where this service serves its Prometheus metrics."""

    model_config = ConfigDict(extra="forbid")

    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="HTTP port of /metrics (Prometheus); 0 picks a free one (see metrics-port-file); "
        "empty = no metrics server.",
    )
    metrics_host: str = Field(default="", description="Address the metrics server binds; empty = --host.")
    metrics_port_file: str = Field(
        default="", description="Write the metrics server's port to this file once listening (launchers)."
    )


class RpcMetrics:
    """Counts and times RPCs; `observer(method)` is called when a call starts, its result at the end."""

    def observer(self, method: str) -> Callable[[grpc.StatusCode], None]:
        service, _, name = method.lstrip("/").rpartition("/")
        started = time.perf_counter()
        done = False

        def observe(code: grpc.StatusCode) -> None:
            nonlocal done
            if done:
                return
            done = True
            label = code.name if isinstance(code, grpc.StatusCode) else str(code)
            RPC_TOTAL.labels(service, name, label).inc()
            RPC_SECONDS.labels(service, name).observe(time.perf_counter() - started)

        return observe


def serve_metrics(settings: TelemetrySettings, default_host: str) -> int | None:
    """Start the /metrics HTTP server on its own thread; returns the bound port (None when off)."""
    if settings.metrics_port is None:
        return None
    host = settings.metrics_host or default_host
    server, _thread = prometheus_client.start_http_server(settings.metrics_port, addr=host)
    port = int(server.server_port)
    if settings.metrics_port_file:
        from pathlib import Path

        path = Path(settings.metrics_port_file)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(path)
    return port
