"""Prometheus /metrics under security, on the real serve skeleton (`start_server`, and one real
process through `run_service`) with a real HTTP client (http.client, run off the event loop).

With security on, /metrics binds 127.0.0.1 unless `--telemetry.metrics-host` says otherwise; it can
require HTTPS with the service's certificate (optionally a client certificate from the run's CA) and a
credential, the run's bearer token or HTTP basic auth: none = 401, a wrong one = 403, two = 401. A
scraper that connects and then says nothing stalls only itself.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import os
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import ServiceSettings
from services.common.security import SecuritySettings
from services.common.serve import RunningServer, start_server
from services.common.telemetry import TelemetrySettings
from services.launch.certs import RunCredentials, issue
from tests.common._serve_entry import TrivialApp

ROOT = Path(__file__).resolve().parents[2]
T = 10.0


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> RunCredentials:
    return issue(tmp_path_factory.mktemp("tls"))


@pytest.fixture(autouse=True)
def _no_ambient_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_TOKEN", raising=False)


def _tls(creds: RunCredentials, *, client_cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(creds.ca))
    if client_cert:
        context.load_cert_chain(creds.operator_cert, creds.operator_key)
    return context


def _get(
    port: int, headers: tuple[tuple[str, str], ...] = (), context: ssl.SSLContext | None = None
) -> tuple[int, dict[str, str], str]:
    """GET /metrics (repeated headers stay repeated): (status, headers, body)."""
    if context is None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=T)
    else:
        connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=T, context=context)
    try:
        connection.putrequest("GET", "/metrics")
        for name, value in headers:
            connection.putheader(name, value)
        connection.endheaders()
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read().decode()
    finally:
        connection.close()


async def _scrape(port: int, *headers: tuple[str, str], context: ssl.SSLContext | None = None):
    return await asyncio.to_thread(_get, port, headers, context)


async def _serve(host: str = "127.0.0.1", security: dict | None = None, **telemetry) -> RunningServer:
    settings = ServiceSettings(
        host=host,
        port=0,
        grace_seconds=0.5,
        security=SecuritySettings(**(security or {})),
        telemetry=TelemetrySettings(metrics_port=0, **telemetry),
    )
    return await start_server(TrivialApp(), settings)


def _bearer(token: str) -> tuple[str, str]:
    return ("Authorization", f"Bearer {token}")


async def test_under_security_metrics_bind_loopback_and_need_tls_and_the_token(creds: RunCredentials) -> None:
    token = creds.token.read_text().strip()
    running = await _serve(
        host="0.0.0.0", security=creds.security_table(mutual=True), metrics_tls=True, metrics_auth="token"
    )
    try:
        assert running.metrics is not None and running.metrics.host == "127.0.0.1"  # not --host 0.0.0.0
        port, tls = running.metrics.port, _tls(creds)

        status, headers, body = await _scrape(port, context=tls)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert "grpo_" not in body and "no credential" in body
        assert (await _scrape(port, _bearer("not-the-token"), context=tls))[0] == 403
        assert (await _scrape(port, ("Authorization", f"Basic {token}"), context=tls))[0] == 401
        # a wrong token, then the right one: ambiguous, refused (and the other order too)
        for pair in ((_bearer("wrong"), _bearer(token)), (_bearer(token), _bearer("wrong"))):
            status, _, body = await _scrape(port, *pair, context=tls)
            assert status == 401 and "ambiguous" in body

        status, _, body = await _scrape(port, _bearer(token), context=tls)
        assert status == 200 and "grpo_service_ready 1.0" in body and "grpo_rpc_seconds" in body

        # plain HTTP to the HTTPS port gets no metrics
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            await _scrape(port, _bearer(token))
    finally:
        await running.close()


async def test_client_certificates_on_metrics(creds: RunCredentials) -> None:
    running = await _serve(
        security=creds.security_table(mutual=True),
        metrics_tls=True,
        metrics_client_cert=True,
        metrics_auth="token",
    )
    token = creds.token.read_text().strip()
    try:
        assert running.metrics is not None
        port = running.metrics.port
        with pytest.raises((ssl.SSLError, ConnectionError)):  # refused in (or right after) the handshake
            await _scrape(port, _bearer(token), context=_tls(creds))
        other = issue(creds.directory.parent / "other-ca")
        with pytest.raises((ssl.SSLError, ConnectionError)):  # a certificate from another CA
            await _scrape(port, _bearer(token), context=_tls(other, client_cert=True))
        status, _, body = await _scrape(port, _bearer(token), context=_tls(creds, client_cert=True))
        assert status == 200 and "grpo_service_ready" in body
    finally:
        await running.close()


async def test_basic_auth_on_metrics(creds: RunCredentials, tmp_path: Path) -> None:
    users = tmp_path / "metrics-users"
    users.write_text("prometheus:s3cret-pw\n")
    running = await _serve(
        security={"token_file": str(creds.token)}, metrics_auth="basic", metrics_basic_auth_file=users
    )
    try:
        assert running.metrics is not None and not running.metrics.tls
        port = running.metrics.port

        def basic(user_password: str) -> tuple[str, str]:
            return ("Authorization", "Basic " + base64.b64encode(user_password.encode()).decode())

        status, headers, _ = await _scrape(port)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
        assert (await _scrape(port, basic("prometheus:wrong")))[0] == 403
        assert (await _scrape(port, basic("someone:s3cret-pw")))[0] == 403
        assert (await _scrape(port, _bearer(creds.token.read_text().strip())))[
            0
        ] == 401  # not this endpoint's
        status, _, body = await _scrape(port, basic("prometheus:s3cret-pw"))
        assert status == 200 and "grpo_service_ready" in body
    finally:
        await running.close()


@pytest.mark.parametrize(
    ("host", "token", "metrics_host", "expected"),
    [
        ("0.0.0.0", "", "", "0.0.0.0"),  # no security: --host, as before
        ("0.0.0.0", "t0ken", "", "127.0.0.1"),  # security on: loopback unless told otherwise
        ("127.0.0.1", "t0ken", "0.0.0.0", "0.0.0.0"),  # --telemetry.metrics-host always wins
    ],
)
async def test_where_metrics_bind(
    host: str, token: str, metrics_host: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if token:
        monkeypatch.setenv("GRPO_TOKEN", token)
    running = await _serve(host=host, metrics_host=metrics_host)
    try:
        assert running.metrics is not None and running.metrics.host == expected
        assert (await _scrape(running.metrics.port))[0] == 200  # no credential asked for: none configured
    finally:
        await running.close()


async def test_a_silent_scraper_does_not_stall_the_next_one(creds: RunCredentials) -> None:
    """One client connects and says nothing (no TLS handshake): a real scrape is still answered."""
    running = await _serve(
        security=creds.security_table(mutual=False), metrics_tls=True, metrics_auth="token"
    )
    token = creds.token.read_text().strip()
    try:
        assert running.metrics is not None
        with socket.create_connection(("127.0.0.1", running.metrics.port), timeout=T):
            status, _, _ = await asyncio.wait_for(
                _scrape(running.metrics.port, _bearer(token), context=_tls(creds)), 3 * T
            )
            assert status == 200
    finally:
        await running.close()


async def test_configurations_metrics_cannot_serve_are_refused(creds: RunCredentials, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="metrics_tls needs this service's certificate"):
        await _serve(metrics_tls=True)
    with pytest.raises(ValueError, match="metrics_auth 'token' needs"):
        await _serve(metrics_auth="token")
    bad = tmp_path / "users"
    bad.write_text("no-colon\n")
    with pytest.raises(ValueError, match="must start with 'user:password'"):
        await _serve(metrics_auth="basic", metrics_basic_auth_file=bad)
    with pytest.raises(ValueError, match="metrics_client_cert needs metrics_tls"):
        await _serve(security=creds.security_table(mutual=True), metrics_client_cert=True)
    with pytest.raises(ValueError, match="go together"):
        TelemetrySettings(metrics_auth="basic")


def test_a_service_process_guards_metrics_from_its_flags(tmp_path: Path) -> None:
    """The real `run_service` with the documented flags: 401 without the token, 200 with it."""
    token = tmp_path / "token"
    token.write_text("pr0cess-token\n")
    metrics_port_file = tmp_path / "metrics-port"
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")} | {"PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "tests/common/_serve_entry.py"),
            *("--port", "0", "--port-file", str(port_file), "--security.token-file", str(token)),
            *("--telemetry.metrics-port", "0", "--telemetry.metrics-port-file", str(metrics_port_file)),
            *("--telemetry.metrics-auth", "token"),
        ],
        cwd=ROOT,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(600):
            if port_file.exists() or process.poll() is not None:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=0.05)
        assert port_file.exists(), process.stderr.read() if process.stderr else ""
        port = int(metrics_port_file.read_text())
        assert _get(port)[0] == 401
        assert _get(port, (_bearer("nope"),))[0] == 403
        status, _, body = _get(port, (_bearer("pr0cess-token"),))
        assert status == 200 and "grpo_service_ready 1.0" in body
        os.kill(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=T)


def test_a_service_process_refuses_metrics_it_cannot_serve(tmp_path: Path) -> None:
    """`--telemetry.metrics-tls` without a certificate: exit 2 and one line, before anything binds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_")} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/common/_serve_entry.py"),
            *("--port", "0", "--telemetry.metrics-port", "0", "--telemetry.metrics-tls"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "test-entry: error: telemetry: metrics_tls needs this service's certificate" in done.stderr
    assert "Traceback" not in done.stderr
