"""Prometheus metrics of a service process, served over HTTP at `/metrics` (prometheus-client).

Every service exports the same base set (the interceptor and the skeleton fill them):

| name                        | type      | labels                | what                               |
|-----------------------------|-----------|-----------------------|------------------------------------|
| grpo_rpc_total              | counter   | service, method, code | RPCs answered, by status code      |
| grpo_rpc_seconds            | histogram | service, method       | RPC latency (call to status)       |
| grpo_event_loop_lag_seconds | histogram |                       | asyncio wake-up delay (100 ms probe) |
| grpo_service_ready          | gauge     |                       | 1 once readiness is SERVING        |

plus prometheus-client's `process_*` and `python_*` collectors, and each service's own metrics:
the app's `metrics_snapshot()` (read at scrape time from the state the service already keeps, so
nothing is mirrored or double-counted; `AppCollector`) and the scheduler's histograms (per step, per call)
(`services/scheduler/observe/metrics.py`). All names are listed in docs/operations.md. Updating a metric is
a few dictionary operations under a lock: cheap enough for the event loop; the HTTP server runs on
prometheus-client's own thread.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple

import grpc
import prometheus_client
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
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


class Reading(NamedTuple):
    """One value of an app's `metrics_snapshot()`: `name` is the full metric name (a counter's
    without `_total`), `labels` its label values."""

    name: str
    help: str
    value: float
    labels: Mapping[str, str] = MappingProxyType({})
    counter: bool = False


class AppCollector(Collector):
    """Exposes an app's `metrics_snapshot()` at scrape time (called on the HTTP thread: it must only
    read plain attributes; a collection that changed size under it is read again)."""

    def __init__(self, snapshot: Callable[[], list[Reading]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        readings: list[Reading] = []
        for _ in range(3):
            try:
                readings = self._snapshot()
                break
            except RuntimeError:  # "changed size during iteration": the loop moved meanwhile
                continue
            except Exception:  # e.g. still loading: a scrape shows the base metrics only
                return
        families: dict[str, Metric] = {}
        label_names: dict[str, list[str]] = defaultdict(list)
        for reading in readings:
            if reading.name not in families:
                label_names[reading.name] = sorted(reading.labels)
                kind = CounterMetricFamily if reading.counter else GaugeMetricFamily
                families[reading.name] = kind(reading.name, reading.help, labels=label_names[reading.name])
            values = [str(reading.labels[k]) for k in label_names[reading.name]]
            families[reading.name].add_metric(values, reading.value)
        yield from families.values()


def register_app(app: object) -> AppCollector | None:
    """Register the app's snapshot (if it has one) with the process registry; undo with unregister."""
    snapshot = getattr(app, "metrics_snapshot", None)
    if snapshot is None:
        return None
    collector = AppCollector(snapshot)
    REGISTRY.register(collector)
    return collector


def unregister(collector: AppCollector | None) -> None:
    if collector is not None:
        REGISTRY.unregister(collector)


_servers: list = []


def serve_metrics(settings: TelemetrySettings, default_host: str) -> int | None:
    """Start the /metrics HTTP server on its own thread; returns the bound port (None when off)."""
    if settings.metrics_port is None:
        return None
    host = settings.metrics_host or default_host
    server, _thread = prometheus_client.start_http_server(settings.metrics_port, addr=host)
    _servers.append(server)
    port = int(server.server_port)
    if settings.metrics_port_file:
        path = Path(settings.metrics_port_file)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(path)
    return port


def stop_metrics(port: int | None) -> None:
    """Shut the /metrics server on `port` down (in-process servers in tests start several)."""
    for server in list(_servers):
        if int(server.server_port) == port:
            server.shutdown()
            server.server_close()
            _servers.remove(server)
