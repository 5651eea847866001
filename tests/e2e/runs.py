"""Reading a demo run from the outside, as the end-to-end tests do: its step rows and its audit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
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
