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
a few dictionary operations under a lock: cheap enough for the event loop; the HTTP server
(`start_metrics`) runs on threads of its own: one accept loop, one thread per connection.

Under security (`--security.*`: TLS or a token) /metrics binds 127.0.0.1 unless told otherwise, and
can require HTTPS with the service's certificate (optionally client certificates) and a credential,
the run's bearer token or HTTP basic auth; without one a request gets 401, with a wrong one 403, and
nothing is collected. The exposition itself is prometheus-client's WSGI app; its own
`start_http_server` has no authentication and does the TLS handshake on its accept loop, where one
silent client would stall every scrape.
"""

from __future__ import annotations

import base64
import hmac
import socket
import ssl
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from socketserver import ThreadingMixIn
from types import MappingProxyType
from typing import Any, Literal, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
import prometheus_client
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.common.logging import get_logger
from services.common.security import SecuritySettings

log = get_logger(__name__)

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
    """`--telemetry.*`: where and how this service serves its Prometheus metrics.

    With security on (`--security.*` sets TLS or a token) /metrics binds 127.0.0.1 unless
    `metrics_host` says otherwise, and can require HTTPS (the service's own certificate, optionally
    client certificates from the run's CA) and a credential (the run's bearer token, or HTTP basic
    auth): what Prometheus' `tls_config`, `authorization` and `basic_auth` send."""

    model_config = ConfigDict(extra="forbid")

    metrics_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="HTTP port of /metrics (Prometheus); 0 picks a free one (see metrics-port-file); "
        "empty = no metrics server.",
    )
    metrics_host: str = Field(
        default="",
        description="Address the metrics server binds; empty = --host, or 127.0.0.1 when --security.* "
        "is on (TLS or a token): serving /metrics beyond this machine is then a choice made here.",
    )
    metrics_port_file: str = Field(
        default="", description="Write the metrics server's port to this file once listening (launchers)."
    )
    metrics_tls: bool = Field(
        default=False,
        description="Serve /metrics over HTTPS with this service's certificate (--security.tls-cert/key).",
    )
    metrics_client_cert: bool = Field(
        default=False,
        description="With --telemetry.metrics-tls: refuse scrapers without a client certificate signed "
        "by --security.tls-ca.",
    )
    metrics_auth: Literal["none", "token", "basic"] = Field(
        default="none",
        description="Credential every /metrics request must carry: 'token' = the run's bearer token "
        "(Authorization: Bearer), 'basic' = HTTP basic auth from --telemetry.metrics-basic-auth-file; "
        "none sent = 401, a wrong one = 403.",
    )
    metrics_basic_auth_file: Path | None = Field(
        default=None,
        description="File whose first line is 'user:password', for --telemetry.metrics-auth basic.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> TelemetrySettings:
        if (self.metrics_auth == "basic") != (self.metrics_basic_auth_file is not None):
            raise ValueError("telemetry: metrics_auth 'basic' and metrics_basic_auth_file go together")
        return self


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


# A scraper that stalls (TLS handshake, request line, headers) loses its connection after this long;
# each connection has a thread of its own, so a frozen one never holds up the next scrape.
IO_TIMEOUT_SECONDS = 10.0
_AUTHORIZATION = "grpo.authorization"  # WSGI environ key: every Authorization header, in order
_LOOPBACK = "127.0.0.1"


class _Credential(NamedTuple):
    """The one `Authorization` value /metrics accepts (`scheme` + `secret`, compared in constant time)."""

    scheme: str  # "Bearer" or "Basic"
    secret: bytes

    def refusal(self, headers: list[str]) -> tuple[str, str] | None:
        """None when the request may be answered, else (HTTP status, why)."""
        if not headers:
            return "401 Unauthorized", f"no credential: send 'Authorization: {self.scheme} ...'"
        if len(headers) > 1:
            return "401 Unauthorized", f"ambiguous credentials: {len(headers)} Authorization headers"
        scheme, _, secret = headers[0].strip().partition(" ")
        if scheme.lower() != self.scheme.lower():
            return "401 Unauthorized", f"scheme {scheme[:16]!r}: send 'Authorization: {self.scheme} ...'"
        if not hmac.compare_digest(secret.strip().encode("utf-8", "surrogateescape"), self.secret):
            return "403 Forbidden", "wrong credential"
        return None


def _credential(settings: TelemetrySettings, security: SecuritySettings) -> _Credential | None:
    if settings.metrics_auth == "token":
        token = security.token()
        if not token:
            raise ValueError("telemetry: metrics_auth 'token' needs --security.token-file or $GRPO_TOKEN")
        return _Credential("Bearer", token.encode())
    path = settings.metrics_basic_auth_file
    if settings.metrics_auth == "basic" and path is not None:  # the settings pair them
        try:
            line = path.read_text(encoding="utf-8").splitlines()[:1]
        except OSError as exc:
            raise ValueError(f"telemetry: cannot read {path}: {exc}") from exc
        user, colon, password = (line[0].strip() if line else "").partition(":")
        if not (user and colon and password):
            raise ValueError(f"telemetry: {path} must start with 'user:password'")
        return _Credential("Basic", base64.b64encode(f"{user}:{password}".encode()))
    return None


def _ssl_context(settings: TelemetrySettings, security: SecuritySettings) -> ssl.SSLContext | None:
    if settings.metrics_client_cert and not settings.metrics_tls:
        raise ValueError("telemetry: metrics_client_cert needs metrics_tls")
    if not settings.metrics_tls:
        return None
    if security.tls_cert is None or security.tls_key is None:
        raise ValueError("telemetry: metrics_tls needs this service's certificate (--security.tls-cert/key)")
    if settings.metrics_client_cert and security.tls_ca is None:
        raise ValueError("telemetry: metrics_client_cert needs --security.tls-ca")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(security.tls_cert, security.tls_key)
        if settings.metrics_client_cert:
            context.load_verify_locations(cafile=security.tls_ca)
            context.verify_mode = ssl.CERT_REQUIRED
    except OSError as exc:  # ssl.SSLError too
        raise ValueError(f"telemetry: cannot load the TLS material for /metrics: {exc}") from exc
    return context


def _guarded(app: Callable, credential: _Credential) -> Callable:
    """The WSGI app behind a credential check: 401/403 with a one-line reason, nothing collected."""

    def guarded(environ: dict, start_response: Callable) -> list[bytes]:
        refusal = credential.refusal(environ.get(_AUTHORIZATION, []))
        if refusal is None:
            return app(environ, start_response)
        status, reason = refusal
        headers = [("Content-Type", "text/plain; charset=utf-8")]
        if status.startswith("401"):
            headers.append(("WWW-Authenticate", f'{credential.scheme} realm="grpo-mesh metrics"'))
        start_response(status, headers)
        return [f"{reason}\n".encode()]

    return guarded


class _Handler(WSGIRequestHandler):
    timeout = IO_TIMEOUT_SECONDS  # applied to the connection before anything is read

    def get_environ(self) -> dict:
        environ = super().get_environ()
        environ[_AUTHORIZATION] = self.headers.get_all("Authorization") or []  # wsgiref joins repeats
        return environ

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: a scrape every few seconds is no log line."""


class _Server(ThreadingMixIn, WSGIServer):
    """One daemon thread per connection; under TLS the handshake runs on that thread too (with the
    I/O timeout), never on the accept loop, so a client that connects and sends nothing stalls
    only itself."""

    daemon_threads = True
    ssl_context: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.ssl_context is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(IO_TIMEOUT_SECONDS)
        with self.ssl_context.wrap_socket(request, server_side=True) as tls:
            super().finish_request(tls, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A failed handshake, a refused client certificate or a stalled client: one debug line."""
        log.debug("metrics connection failed", client=str(client_address[0]), error=repr(sys.exc_info()[1]))


class MetricsServer:
    """A running /metrics endpoint (HTTP or HTTPS) on a thread of its own."""

    def __init__(self, server: _Server, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def tls(self) -> bool:
        return self._server.ssl_context is not None

    def close(self) -> None:
        """Stop serving and free the port (blocks up to the serve loop's 0.5 s poll: call off the loop)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(IO_TIMEOUT_SECONDS)


def metrics_bind_host(settings: TelemetrySettings, security: SecuritySettings, default_host: str) -> str:
    """Where /metrics listens: the setting, else 127.0.0.1 under security (TLS or a token), else --host."""
    if settings.metrics_host:
        return settings.metrics_host
    return _LOOPBACK if security.tls or bool(security.token()) else default_host


def check_metrics(settings: TelemetrySettings, security: SecuritySettings) -> None:
    """ValueError (one line) when /metrics is configured in a way this process cannot serve; also
    reads the token file, so an unreadable one is reported here too (before anything binds)."""
    security.token()
    if settings.metrics_port is not None:
        _ssl_context(settings, security)
        _credential(settings, security)


def start_metrics(
    settings: TelemetrySettings, security: SecuritySettings, default_host: str
) -> MetricsServer | None:
    """Start /metrics on its own thread (None when off); ValueError for a configuration it cannot serve.

    Blocking (reads the certificate and credential files, binds, resolves the host): call it off the
    event loop (`asyncio.to_thread`)."""
    if settings.metrics_port is None:
        return None
    host = metrics_bind_host(settings, security, default_host)
    context = _ssl_context(settings, security)
    credential = _credential(settings, security)
    app = prometheus_client.make_wsgi_app(REGISTRY)
    if credential is not None:
        app = _guarded(app, credential)
    infos = socket.getaddrinfo(host, settings.metrics_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)

    class Server(_Server):
        address_family = infos[0][0]

    server = make_server(host, settings.metrics_port, app, server_class=Server, handler_class=_Handler)
    server.ssl_context = context
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    running = MetricsServer(server, thread)
    if settings.metrics_port_file:
        path = Path(settings.metrics_port_file)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(str(running.port))
        tmp.replace(path)
    secured = security.tls or bool(security.token())
    if secured and credential is None and host not in {_LOOPBACK, "localhost", "::1"}:
        log.warning(
            "/metrics is reachable beyond this machine without a credential",
            host=host,
            hint="--telemetry.metrics-auth token (or basic) and --telemetry.metrics-tls",
        )
    return running
