"""Supervision with real processes: a service killed with SIGKILL comes back on its port; one that
keeps dying ends the run; what a service started dies with it (its process group)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from services.launch.processes import ServiceFailed, ServiceProcess
from services.launch.supervisor import RestartPolicy, Supervisor


async def _until(condition, timeout: float = 60.0) -> None:  # noqa: ASYNC109 (a test's hard limit)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def test_a_killed_service_is_restarted_on_the_same_port(tmp_path: Path) -> None:
    env = ServiceProcess("env", tmp_path)
    env.start()
    said: list[str] = []
    supervisor = Supervisor([env], RestartPolicy(backoff_s=0.2), say=said.append)
    try:
        address = await env.wait_ready(120)
        first_pid = env.process.pid
        os.kill(first_pid, signal.SIGKILL)
        await _until(lambda: (supervisor.check(), env.process.pid != first_pid)[1])
        assert await env.wait_ready(120) == address  # the same port: peers find it again
        assert supervisor.restarts["env"] == 1
        assert said[0] == "env exited with code -9; restarting it in 0.2 s"
        assert "restarted env" in said[1]
    finally:
        env.terminate()


async def test_a_service_that_keeps_dying_ends_the_run(tmp_path: Path) -> None:
    env = ServiceProcess("env", tmp_path, ["--no-such-flag"])  # exits at once, every time
    env.start()
    supervisor = Supervisor([env], RestartPolicy(max_restarts=2, backoff_s=0.05), say=lambda _: None)
    with pytest.raises(ServiceFailed, match="restart limit 2"):
        await _until(lambda: supervisor.check() and False, timeout=60)
    assert supervisor.restarts["env"] == 2


async def test_what_a_service_started_dies_with_it(tmp_path: Path) -> None:
    """kill_leftovers stops the service's whole process group: a child it started (as vLLM starts its
    engine) does not outlive it."""
    child = (
        "import subprocess, sys, time; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    )
    proc = ServiceProcess("env", tmp_path)
    proc.process = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)  # noqa: ASYNC220
    await _until(lambda: len(psutil.Process(proc.process.pid).children()) == 1)
    grandchild = psutil.Process(proc.process.pid).children()[0]
    os.kill(proc.process.pid, signal.SIGKILL)
    proc.process.wait()
    assert grandchild.is_running()  # SIGKILL of the parent alone leaves it
    proc.kill_leftovers()
    await _until(lambda: not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE)


def test_stopping_asks_every_service_at_once(tmp_path: Path) -> None:
    """A launcher told to stop while its services load (each slow to act on SIGTERM) must not wait
    one grace period per service: every one is asked before the first is waited for."""
    from services.launch.processes import terminate_all

    script = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    open(sys.argv[1], 'a').write(f'term {time.monotonic()}\\n')\n"
        "    time.sleep(1.0)  # a model load finishing before the process can stop\n"
        "    open(sys.argv[1], 'a').write(f'exit {time.monotonic()}\\n')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "open(sys.argv[1] + '.ready', 'w').close()\n"
        "while True: time.sleep(0.1)\n"
    )
    services = []
    for name in ("scheduler", "learner"):
        log = tmp_path / name
        process = subprocess.Popen([sys.executable, "-c", script, str(log)], start_new_session=True)
        services.append((ServiceProcess(name, tmp_path, process=process), log))
    for _, log in services:
        deadline = time.monotonic() + 60
        while not Path(f"{log}.ready").exists():
            assert time.monotonic() < deadline, "the stand-in service did not start"
            time.sleep(0.05)
    terminate_all([s for s, _ in services])
    first, second = (
        {k: float(v) for k, v in (line.split() for line in log.read_text().splitlines())}
        for _, log in services
    )
    assert second["term"] < first["exit"]  # asked before the first had stopped
    assert all(s.process.returncode == 0 for s, _ in services)
