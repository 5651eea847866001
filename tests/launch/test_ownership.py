"""One launcher per run directory, and its services die with it: real launchers (a process that claims
the run directory and starts a real env service the way `grpo-mesh demo` does), killed with SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.launch import liveset
from services.launch.ownership import RunDirBusy, RunOwner
from services.launch.processes import ServiceProcess

# claims the run directory, starts an env service, says the pids, and waits to be killed
LAUNCHER = """
import json, sys, time
from pathlib import Path
from services.launch.ownership import RunOwner
from services.launch.processes import ServiceProcess
run_dir = Path(sys.argv[1])
owner = RunOwner.claim(run_dir)
env = ServiceProcess("env", run_dir)
owner.track(env)
env.start()
watchdog = owner._watchdog.pid if owner._watchdog else None
print(json.dumps({"env": env.process.pid, "watchdog": watchdog}), flush=True)
time.sleep(600)
"""

# makes one of our shared-memory segments and exits without unlinking it (as a SIGKILL would leave it)
LEAK = """
from multiprocessing import resource_tracker
from services.transports import shared_memory as shm
segment = shm.create_segment(shm.segment_name("launchtest", 1), 16)
resource_tracker.unregister(segment._name, "shared_memory")
print(segment.name, flush=True)
"""


def _gone(pid: int, timeout: float = 60.0) -> bool:
    """Whether `pid` stops running (exits, or is a zombie) within `timeout` (a bound, not a timing)."""
    started = liveset.start_time(pid)
    deadline = time.monotonic() + timeout
    while started is not None and liveset.running(pid, started):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _freeze(pid: int, timeout: float = 60.0) -> None:
    """SIGSTOP `pid`'s group and wait until `pid` is stopped. A stop takes effect only when the process
    next runs: on a busy machine a death signal sent before that is dequeued first (the lower signal
    number) and, while the service has no handler yet, ends it instead of finding it frozen."""
    os.killpg(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "T":
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.01)


def _kill_watchdog(pids: dict[str, int | None]) -> None:
    assert pids["watchdog"], "the launcher started no watchdog"
    os.kill(pids["watchdog"], signal.SIGKILL)


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, dict[str, int]]]:
    """A real launcher on tmp_path/run with its env service started; everything killed by pid after."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    pids = json.loads(proc.stdout.readline())
    record = liveset.read(tmp_path / "run")
    assert record is not None and [m.pid for m in record.services] == [pids["env"]]
    yield proc, pids
    proc.kill()
    proc.wait()
    for pid in filter(None, pids.values()):
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)


def test_a_second_launcher_is_refused_while_the_first_lives(tmp_path: Path, launcher) -> None:
    proc, _ = launcher
    with pytest.raises(RunDirBusy, match=f"in use by launcher with pid {proc.pid}; stop it first"):
        RunOwner.claim(tmp_path / "run")
    proc.kill()
    proc.wait()
    RunOwner.claim(tmp_path / "run", say=lambda _: None).release()  # free once it is gone


def test_a_service_dies_with_its_launcher_killed_by_sigkill(launcher) -> None:
    proc, pids = launcher
    _kill_watchdog(pids)  # the kernel's death signal alone
    proc.kill()
    assert _gone(pids["env"]), "the env service outlived its launcher"


def test_the_watchdog_stops_a_frozen_service_of_a_killed_launcher(tmp_path: Path, launcher) -> None:
    proc, pids = launcher
    _freeze(pids["env"])  # hung: the death signal stays pending
    proc.kill()
    assert _gone(pids["env"]), "the frozen env service outlived its launcher"
    assert pids["watchdog"] and _gone(pids["watchdog"])
    assert liveset.read(tmp_path / "run") is None  # the watchdog removed the record


def test_a_new_launcher_stops_what_a_dead_one_left_running(tmp_path: Path, launcher) -> None:
    proc, pids = launcher
    _freeze(pids["env"])
    _kill_watchdog(pids)
    proc.kill()
    proc.wait()
    time.sleep(1.0)
    env_started = liveset.start_time(pids["env"])
    assert env_started and liveset.running(pids["env"], env_started), "the frozen env should be left running"
    said: list[str] = []
    owner = RunOwner.claim(tmp_path / "run", say=said.append)
    try:
        assert _gone(pids["env"], timeout=0)  # stopped before claim returned
        assert said[0] == f"stopping what launcher pid {proc.pid} left running: env (pid {pids['env']})"
    finally:
        owner.release()


def test_release_reclaims_the_segments_of_dead_creators(tmp_path: Path) -> None:
    leak = subprocess.run([sys.executable, "-c", LEAK], capture_output=True, text=True, timeout=120)
    assert leak.returncode == 0, leak.stderr
    name = leak.stdout.strip()
    assert (Path("/dev/shm") / name).exists()
    said: list[str] = []
    RunOwner.claim(tmp_path, say=said.append).release()
    assert not (Path("/dev/shm") / name).exists()
    assert any(name in line and line.startswith("reclaimed") for line in said), said


async def test_a_service_is_recorded_by_the_process_it_was(tmp_path: Path) -> None:
    """Once stopped and reaped, its pid may be anyone's: the record keeps the start time read at start."""
    env = ServiceProcess("env", tmp_path)
    env.start()
    try:
        first = env.member()
        assert first is not None and first.running()
        await env.wait_ready(120)
        assert env.member() == liveset.Member("env", first.pid, first.start_time, env.port) and env.port
    finally:
        env.terminate()
    assert env.member() == liveset.Member("env", first.pid, first.start_time, env.port)
    assert not first.running()
