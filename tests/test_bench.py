"""The scheduler benchmark runs and reports what it claims to measure (never how fast: no timing
assertion). It drives the real `Orchestrator` against stub peers, in-process and over loopback gRPC,
so a change that breaks the scheduler's loop or its clients fails here as well as in its own tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_scheduler_benchmark_routes_every_completion_into_trained_batches() -> None:
    steps, warmup, groups, group_size = 12, 3, 4, 8
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scheduler.py"), "--rollouts", "1", "2", "--steps", str(steps),
         "--warmup-steps", str(warmup), "--groups-per-batch", str(groups), "--group-size", str(group_size),
         "--empty-calls", "50", "--mode", "both", "--repeats", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    results = json.loads(out.stdout)["results"]
    assert sorted((r["mode"], r["rollouts"]) for r in results) == [
        ("inproc", 1), ("inproc", 2), ("loopback", 1), ("loopback", 2)
    ]  # fmt: skip
    for r in results:
        assert r["completions_routed"] == steps * groups * group_size, r  # after the warm-up steps
        assert r["groups_dropped"] == 0 and r["completions_per_s"] > 0
        assert 0 <= r["added_p50_ms"] <= r["added_p99_ms"] <= r["added_max_ms"]
