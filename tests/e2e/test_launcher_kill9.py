"""kill -9 of the launcher, as a user would do it to `grpo-mesh demo`: its services die with it; a
second launcher on a run directory that a live one runs is refused; and `--resume` after a launcher
whose services stayed up (frozen with SIGSTOP, its watchdog killed too) stops them before starting its
own, so the run never has two sets. Real launchers, real services (the transformers engine, and vLLM
with its engine processes for kill -9), real signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from services.launch import liveset

pytestmark = pytest.mark.slow

ROLES = {"env", "learner", "rollout-0", "scheduler"}
START_LIMIT_S = 420  # a hard bound on a loaded 2-core machine: the test never hangs CI
GONE_LIMIT_S = 60


def _command(run_dir: Path, model: Path, *extra: str) -> list[str]:
    """The demo on `run_dir` (the transformers engine unless `extra` names another), far from its end."""
    return [
        sys.executable, "-m", "services", "demo", "--steps", "400", "--run-dir", str(run_dir),
        "--model", str(model), "--engine", "transformers", "--eval-every", "0", "--groups-per-batch", "2",
        "--no-metrics", *extra,
    ]  # fmt: skip


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    rows = path.read_text().splitlines() if path.exists() else []
    return sum(1 for row in rows if '"reward_mean"' in row)


def _until(condition, what: str, launcher: subprocess.Popen, limit: float = START_LIMIT_S):
    deadline = time.monotonic() + limit
    while not (result := condition()):
        assert launcher.poll() is None, f"the launcher exited ({launcher.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return result


def _running(run_dir: Path, launcher: subprocess.Popen) -> liveset.Record | None:
    """The record once all four services of `launcher` are up (the scheduler's port is known)."""
    record = liveset.read(run_dir)
    if record is None or record.launcher.pid != launcher.pid or {m.role for m in record.services} != ROLES:
        return None
    return record if all(m.port for m in record.services) else None


def _still_running(processes: list[psutil.Process]) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(processes, timeout=GONE_LIMIT_S)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _processes_of(run_dir: Path) -> dict[str, list[int]]:
    """Which processes run a service on this run directory's config, by role (found to count them)."""
    config, found = str(run_dir / "run.toml"), {}
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = proc.info["cmdline"] or []
        if config in cmdline and proc.info["status"] not in (psutil.STATUS_ZOMBIE, psutil.STATUS_STOPPED):
            role = next((c.removeprefix("services.") for c in cmdline if c.startswith("services.")), "?")
            found.setdefault(role, []).append(proc.info["pid"])
    return found


@dataclass
class Runs:
    """What a test started: launchers, and the services' processes it has seen (killed by pid after)."""

    launchers: list[subprocess.Popen] = field(default_factory=list)
    processes: list[psutil.Process] = field(default_factory=list)

    def everything(self, record: liveset.Record) -> list[psutil.Process]:
        """Every process of the recorded services' process groups (vLLM's engine processes too)."""
        found = [psutil.Process(pid) for m in record.services for pid in m.leftovers()]
        self.processes += found
        return found


@pytest.fixture
def runs() -> Iterator[Runs]:
    started = Runs()
    yield started
    for launcher in started.launchers:
        with contextlib.suppress(ProcessLookupError):
            launcher.kill()
        launcher.wait()
    for process in started.processes:  # psutil checks it is still the same process before signalling
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def _launch(tmp_path: Path, command: list[str], name: str) -> subprocess.Popen:
    log = (tmp_path / f"{name}.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


@pytest.mark.parametrize("engine", ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)])
def test_kill_9_of_the_launcher_takes_its_services_with_it(
    tmp_path: Path, warm_model_dir: Path, runs: Runs, engine: str
) -> None:
    run_dir = tmp_path / "run"
    launcher = _launch(tmp_path, _command(run_dir, warm_model_dir, "--engine", engine), "launcher")
    runs.launchers.append(launcher)
    record = _until(lambda: _running(run_dir, launcher), "the services to be up", launcher)
    _until(lambda: _steps(run_dir) >= 1, "a first step", launcher)  # mid-run
    processes = runs.everything(record)
    if engine == "vllm":
        (rollout,) = [m for m in record.services if m.role == "rollout-0"]
        assert len(rollout.leftovers()) > 1, "the rollout had no engine processes to check"
    launcher.send_signal(signal.SIGKILL)  # the launcher alone: its services are in sessions of their own
    assert launcher.wait() == -signal.SIGKILL
    assert not _still_running(processes), "services outlived their launcher"
    deadline = time.monotonic() + GONE_LIMIT_S
    while liveset.read(run_dir) is not None:  # the watchdog found nothing left and let go
        assert time.monotonic() < deadline, "the record of a dead launcher was never removed"
        time.sleep(0.2)


def test_one_launcher_per_run_dir_and_resume_stops_what_a_dead_one_left(
    tmp_path: Path, warm_model_dir: Path, runs: Runs
) -> None:
    run_dir = tmp_path / "run"
    first = _launch(tmp_path, _command(run_dir, warm_model_dir), "first")
    runs.launchers.append(first)
    record = _until(lambda: _running(run_dir, first), "the first launcher's services", first)

    second = subprocess.run(
        _command(run_dir, warm_model_dir, "--resume"), capture_output=True, text=True, timeout=120
    )
    assert second.returncode == 1, second.stdout + second.stderr
    assert f"is in use by launcher with pid {first.pid}; stop it first" in second.stderr
    assert first.poll() is None and liveset.read(run_dir) == record  # untouched

    # the first launcher dies while its services stay up: frozen (the kernel's SIGTERM stays pending),
    # and its watchdog killed first, so nothing of the first launcher is left to stop them
    processes = runs.everything(record)
    for member in record.services:
        os.killpg(member.pid, signal.SIGSTOP)
    (watchdog,) = [
        c for c in psutil.Process(first.pid).children() if "services.launch.watchdog" in c.cmdline()
    ]
    watchdog.kill()
    first.kill()
    first.wait()
    time.sleep(2.0)
    assert all(p.is_running() for p in processes), "the left-behind services should still be there"

    third = _launch(tmp_path, _command(run_dir, warm_model_dir, "--resume"), "third")
    runs.launchers.append(third)
    _until(lambda: _running(run_dir, third), "the resumed launcher's services", third)
    assert not _still_running(processes), "--resume left the first launcher's services running"
    found = _processes_of(run_dir)
    assert {role: len(pids) for role, pids in found.items()} == {
        "env": 1, "learner": 1, "rollout": 1, "scheduler": 1,
    }, found  # fmt: skip
    log = (tmp_path / "third.log").read_text()
    assert f"stopping what launcher pid {first.pid} left running" in log, log[-3000:]

    steps_before = _steps(run_dir)
    _until(lambda: _steps(run_dir) > steps_before, "the resumed run to train", third)
    resumed = liveset.read(run_dir)
    assert resumed is not None
    processes = runs.everything(resumed)
    third.send_signal(signal.SIGTERM)  # stopped the ordinary way: services stopped, the record removed
    assert third.wait(timeout=120) == 143
    assert not [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert liveset.read(run_dir) is None, "the launcher's record outlived it"
