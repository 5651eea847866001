"""The terminal status view: rendered from GetStatus messages (pure) and its CLI's exit codes.
The view against a live scheduler is in tests/e2e/test_scheduler_services.py."""

from __future__ import annotations

import io
import subprocess
import sys

from rich.console import Console

from grpo.scheduler.v1 import scheduler_pb2
from services.scheduler.status_view import render


def _text(status: scheduler_pb2.GetStatusResponse) -> str:
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(render(status, "127.0.0.1:50050"))
    return console.export_text()


def _status(**overrides) -> scheduler_pb2.GetStatusResponse:
    status = scheduler_pb2.GetStatusResponse(
        learner_version=12, step=12, max_steps=40, reward_mean=0.4375, loss=-0.0123, steps_per_second=3.5,
        tokens_per_second=812, staleness_mean=0.62, logprob_abs_diff_max=2.4e-6,
        weight_transport="grpc_stream", uptime_seconds=3725,
        last_sync=scheduler_pb2.SyncPhases(prepare_ms=1.5, stage_ms=20.25, commit_ms=8.0, total_ms=29.75),
        rollouts=[
            scheduler_pb2.RolloutLoad(rollout_id="rollout-0", address="127.0.0.1:7001", weight_version=12,
                                      in_flight=3, max_in_flight=16, healthy=True),
            scheduler_pb2.RolloutLoad(rollout_id="rollout-1", address="127.0.0.1:7002", weight_version=11,
                                      in_flight=0, max_in_flight=16, healthy=False),
        ],
    )  # fmt: skip
    status.queue_depths.update({"prompts": 64, "scored": 2})
    status.groups_by_state.update({"issued": 5, "trained": 192})
    for key, value in overrides.items():
        setattr(status, key, value)
    return status


def test_a_healthy_run_shows_progress_rates_sync_and_rollouts() -> None:
    text = _text(_status())
    for needle in (
        "12/40 (30%)", "training", "3.50", "812", "0.4375", "-0.01230", "2.40e-06", "1h02m05s",
        "29.8 ms (prepare 1.5 · stage 20.2 · commit 8.0) via grpc_stream", "queue prompts", "64",
        "groups trained", "192", "rollout-0", "3/16", "✓", "rollout-1", "✗",
    ):  # fmt: skip
        assert needle in text, needle


def test_paused_finished_and_failed_runs_say_so() -> None:
    assert "paused" in _text(_status(paused=True))
    assert "finished" in _text(_status(finished=True, step=40))
    failed = _text(_status(error="AlignmentError: logprobs differ by 0.3"))
    assert "failed" in failed and "AlignmentError: logprobs differ by 0.3" in failed


def test_an_unreachable_scheduler_is_exit_code_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.scheduler", "status", "--address", "127.0.0.1:1", "--timeout", "2"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "unreachable" in done.stderr
