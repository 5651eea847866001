"""A learner of two ranks (torchrun, FSDP2 over Gloo) in a whole run, and kill -9 of one rank.

`grpo-mesh demo --learner-ranks 2` (all services as processes, the transformers engine) trains; at
step KILL_AT rank 1 of the learner (a process torchrun started, not the launcher's child) is killed
with SIGKILL, mid-run. Rank 0 must not wait on it: its collective fails, it exits, torchrun ends, the
launcher restarts the learner (both ranks), which resumes from its sharded checkpoint, and the
scheduler re-trains what the checkpoint lacks. The run must finish every step, versions must advance
by one (a rewind announced by its row), learner and rollout logprobs must agree (≤ 1e-4), the audit
must pass, and no rank may outlive the run. The stall (the longest gap between step rows) is printed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.runs import audit, run_killing, versions_advance_by_one

pytestmark = [pytest.mark.slow]

STEPS = 40
KILL_AT = 12
RUN_LIMIT_S = 420  # a hard bound: the test can never hang CI


def _rank(launcher: psutil.Process, rank: str) -> psutil.Process | None:
    """The learner process of `rank` under the launcher's torchrun (found by pid and its RANK)."""
    for process in launcher.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "services.learner" in process.cmdline() and process.environ().get("RANK") == rank:
                return process
    return None


def test_a_two_rank_learner_trains_and_survives_kill_9_of_a_rank(
    tmp_path: Path, warm_model_dir: Path
) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "services", "demo", "--steps", str(STEPS), "--run-dir", str(run_dir),
        "--model", str(warm_model_dir), "--engine", "transformers", "--device", "cpu", "--eval-every", "0",
        "--checkpoint-every", "5", "--learner-ranks", "2",
    ]  # fmt: skip
    run = run_killing(command, run_dir, tmp_path / "launcher.log", [(KILL_AT, "1")], RUN_LIMIT_S, find=_rank)
    assert run.returncode == 0, run.output[-4000:]
    assert [rank for rank, _ in run.killed] == ["1"], run.killed
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    assert '"ranks": 2' in learner_log and "a learner rank failed" in learner_log  # rank 0 gave up
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {"learner": 1}, summary
    assert summary["logprob_abs_diff_max"] <= 1e-4, summary
    time.sleep(1)
    assert not [p for p in run.seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "orphans"

    times = versions_advance_by_one(run_dir, STEPS)
    audit_output, counts = audit(run_dir)
    assert int(counts["steps"]) == STEPS and int(counts["learner_restarts"]) == 1
    stall = max(b - a for a, b in itertools.pairwise(times))
    print(audit_output, run.killed, f"stall (longest gap between step rows): {stall:.1f} s")
