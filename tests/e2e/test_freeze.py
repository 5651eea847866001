"""Hung is not dead, end to end: `grpo-mesh demo` (two rollouts) while the env, the learner and one
rollout are each frozen with SIGSTOP (the whole process tree) for longer than the scheduler's
deadlines on calls to them, then continued with SIGCONT.

A frozen env or learner is waited for (the scheduler's calls to it time out and are made again), so
the run goes on where it stopped; a frozen rollout is dropped from the weight sync and its groups go
to the other rollout, so training does not wait for it at all; it catches up when it runs again. No
service is restarted (a freeze is not a crash), the run reaches its last step and exits 0, versions
advance one per step, and the audit passes.

The scheduler's deadlines are shortened through its environment variables (`GRPO_SCHEDULER__…`) so
that seconds-long freezes exceed them; the freeze points are step counts read from `metrics.jsonl`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.runs import audit, kill_what_is_left, rows, trained_step

pytestmark = [pytest.mark.slow]

STEPS = 36
FREEZE_S = 8.0
FREEZES = [(4, "env"), (12, "learner"), (20, "rollout-1")]
RUN_LIMIT_S = 480  # a hard bound: the test can never hang CI
DEADLINES = {  # each well under FREEZE_S
    "GRPO_SCHEDULER__TIMEOUTS__CONTROL": "2",
    "GRPO_SCHEDULER__TIMEOUTS__HEALTH": "2",
    "GRPO_SCHEDULER__TIMEOUTS__PROBE": "2",
    "GRPO_SCHEDULER__TIMEOUTS__SCORE": "2",
    "GRPO_SCHEDULER__TIMEOUTS__TRANSFER__FLOOR_S": "2",
}


def _service(launcher: psutil.Process, name: str) -> psutil.Process:
    """The launcher's child serving `name` (env, learner, rollout-<i>), found by pid and arguments."""
    for child in launcher.children():
        with contextlib.suppress(psutil.NoSuchProcess):
            command = child.cmdline()
            if (name.startswith("rollout-") and name in command) or f"services.{name}" in command:
                return child
    raise AssertionError(f"no {name} process under the launcher")


def _signal_tree(process: psutil.Process, sig: signal.Signals) -> None:
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)


def test_a_run_waits_for_frozen_peers_and_trains_past_a_frozen_rollout(
    tmp_path: Path, warm_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "services", "demo", "--steps", str(STEPS), "--run-dir", str(run_dir),
        "--model", str(warm_model_dir), "--engine", "transformers", "--rollouts", "2", "--eval-every", "0",
        "--groups-per-batch", "4", "--group-size", "4",
    ]  # fmt: skip
    log = (tmp_path / "launcher.log").open("w")
    launcher = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **DEADLINES}
    )
    parent = psutil.Process(launcher.pid)
    seen: set[psutil.Process] = set()
    frozen: list[tuple[str, int, int]] = []  # (service, step when frozen, step when continued)
    started = time.monotonic()
    try:
        for at, name in FREEZES:
            while trained_step(run_dir) < at:
                assert launcher.poll() is None, "the launcher exited before the freezes"
                assert time.monotonic() - started < RUN_LIMIT_S, "the run did not reach its freezes in time"
                seen.update(parent.children(recursive=True))
                time.sleep(0.2)
            victim = _service(parent, name)
            _signal_tree(victim, signal.SIGSTOP)
            before = trained_step(run_dir)
            time.sleep(FREEZE_S)
            during = trained_step(run_dir)
            _signal_tree(victim, signal.SIGCONT)
            frozen.append((name, before, during))
        while launcher.poll() is None:
            assert time.monotonic() - started < RUN_LIMIT_S, "the run did not finish in time"
            seen.update(parent.children(recursive=True))
            time.sleep(0.2)
        output = (tmp_path / "launcher.log").read_text()
        assert launcher.returncode == 0, output[-4000:]
    finally:
        kill_what_is_left(launcher, seen)
        log.close()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert not summary["restarts"], f"a freeze is not a crash: {summary['restarts']}"
    _, rollout_before, rollout_during = frozen[2]
    assert rollout_during >= rollout_before + 2, f"training waited for the frozen rollout: {frozen}"

    expected, measured = 1, 0
    for row in rows(run_dir):
        if "reward_mean" in row:
            assert row["weight_version"] == expected, row
            diff = row["logprob_abs_diff_max"]  # null: no rollout answered that step's probe
            assert diff is None or diff <= 1e-4, row
            measured += diff is not None
            expected += 1
    assert expected == STEPS + 1 and measured > 0

    _, counts = audit(run_dir)
    assert counts["steps"] == STEPS and counts["scheduler_starts"] == 1
