"""`python -m services.gateway` as a process: --help, a bad command line, serving, and SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
CMD = [sys.executable, "-m", "services.gateway"]


def test_help_and_a_bad_command_line() -> None:
    shown = subprocess.run([*CMD, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (
        shown.returncode == 0
        and "--rollouts" in shown.stdout
        and "--admission.per-rollout-in-flight" in shown.stdout
    )
    bad = subprocess.run(
        [*CMD, "--rollouts", "nohost"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "--rollouts" in bad.stderr and "host:port" in bad.stderr


def test_serves_then_stops_on_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "gateway.port"
    log = (tmp_path / "gateway.log").open("w")
    process = subprocess.Popen(
        [*CMD, "--rollouts", "127.0.0.1:1", "--port-file", str(port_file), "--timeouts.health-s", "0.5"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not port_file.exists():
            assert process.poll() is None and time.monotonic() < deadline, (
                tmp_path / "gateway.log"
            ).read_text()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        assert httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"] == "grpo-mesh"
        assert httpx.get(url + "/health", timeout=30).status_code == 503  # no rollout behind it
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    assert process.returncode in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once drained
    assert "gateway stopped" in (tmp_path / "gateway.log").read_text()  # the lifespan's shutdown ran
