"""Reading a demo run from the outside, as the end-to-end tests do: its step rows and its audit, and
running one while its services are killed (`run_killing`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil


def rows(run_dir: Path) -> list[dict]:
    """Every complete row of `metrics.jsonl` (the line being written is left out)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # the line being written
            found.append(json.loads(line))
    return found


def versions_advance_by_one(run_dir: Path, steps: int) -> list[float]:
    """Assert that each step row's weight version is the one before plus one (a learner rewind is
    announced by a row of its own) up to `steps`; the step rows' times."""
    expected, times = 1, []
    for row in rows(run_dir):
        if row.get("event") == "learner_rewind":
            expected = row["weight_version"] + 1
        elif "reward_mean" in row:
            assert row["weight_version"] == expected, row
            expected += 1
            times.append(row["time"])
    assert expected == steps + 1
    return times


def trained_step(run_dir: Path) -> int:
    """The newest step with a step row (0 before the first)."""
    return max((r["step"] for r in rows(run_dir) if "reward_mean" in r), default=0)


def audit(run_dir: Path) -> tuple[str, dict[str, int]]:
    """`grpo-mesh audit run_dir`, which must pass: its output and its counts by name."""
    done = subprocess.run(
        [sys.executable, "-m", "services", "audit", str(run_dir)],  # = grpo-mesh audit
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, {
        name: int(n) for name, n in (line.split() for line in done.stdout.splitlines()[1:-1])
    }


def kill_what_is_left(launcher: subprocess.Popen, seen: set[psutil.Process]) -> None:
    """After a run, passed or failed: SIGKILL the launcher's group if it still runs, and every process
    group seen under it (ours, by pid; never by name)."""
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
    for process in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def service_process(launcher: psutil.Process, name: str) -> psutil.Process | None:
    """The launcher's own child running `python -m services.<name>` (found by pid, killed by pid)."""
    for child in launcher.children():
        try:
            if f"services.{name}" in child.cmdline():
                return child
        except psutil.NoSuchProcess:
            continue
    return None


@dataclass
class KilledRun:
    """A demo run that was sent faults: its exit status and output, the kills made (service, step),
    and every process seen under the launcher."""

    returncode: int
    output: str
    killed: list[tuple[str, int]]
    seen: set[psutil.Process]


def run_killing(
    command: list[str],
    run_dir: Path,
    log_path: Path,
    kills: list[tuple[int, str]],
    limit_s: float,
    before_kill: Callable[[str, psutil.Process], None] | None = None,
    find: Callable[[psutil.Process, str], psutil.Process | None] = service_process,
) -> KilledRun:
    """Run `command` (a `grpo-mesh demo`) in a session of its own and SIGKILL each service of `kills`
    (step, name) once the run has trained that step; `before_kill(name, victim)` sees each victim
    first. `find(launcher, name)` picks the victim (default: the launcher's child running the
    service). Whatever is left is killed afterwards, passed or failed; the run must end within
    `limit_s`."""
    log = log_path.open("w")
    launcher = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    parent = psutil.Process(launcher.pid)
    seen: set[psutil.Process] = set()
    killed: list[tuple[str, int]] = []
    started = time.monotonic()
    try:
        pending = list(kills)
        while launcher.poll() is None:
            assert time.monotonic() - started < limit_s, "the run did not finish in time"
            seen.update(parent.children(recursive=True))
            if pending and trained_step(run_dir) >= pending[0][0]:
                name = pending[0][1]
                victim = find(parent, name)
                if victim is not None:
                    if before_kill is not None:
                        before_kill(name, victim)
                    victim.send_signal(signal.SIGKILL)  # this process only: its children are on their own
                    killed.append((name, trained_step(run_dir)))
                    pending.pop(0)
            time.sleep(0.2)
    finally:
        kill_what_is_left(launcher, seen)
        log.close()
    return KilledRun(launcher.returncode, log_path.read_text(), killed, seen)
