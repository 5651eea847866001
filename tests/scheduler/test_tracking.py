"""TensorBoard and W&B tracking of a run: the tag mapping, event files read back, W&B offline."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.scheduler.tracking import Tracker, TrackingSettings, scalars

ROWS = [
    {
        "step": s,
        "reward_mean": 0.1 * s,
        "loss": 1.0 / s,
        "learner/grad_norm": 2.0 * s,
        "sync_ms": 10.0 + s,
        "sync_stage_ms": 4.0,
        "staleness_max": 1,
        "retrained": False,
        "behaviour_versions": [s - 1],
        "weight_transport": "grpc_stream",
        "time": 1.7e9,
    }
    for s in range(1, 6)
]


def test_scalars_map_keys_to_groups_and_skip_what_is_not_a_number() -> None:
    step, values = scalars({**ROWS[0], "loss": math.nan, "eval/accuracy": 0.5})
    assert step == 1
    assert values == {
        "train/reward_mean": 0.1,
        "learner/grad_norm": 2.0,
        "sync/total_ms": 11.0,
        "sync/stage_ms": 4.0,
        "staleness/max": 1.0,
        "eval/accuracy": 0.5,
    }
    assert scalars({"event": "learner_rewind", "step": 7, "to_version": 3}) == (
        7,
        {"events/learner_rewind": 1.0},
    )
    assert scalars({"event": "no step"}) is None


def _series(directory: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]


def test_tensorboard_event_files_hold_the_run(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, TrackingSettings(), run_name="grpo-test")
    for row in ROWS:
        tracker.log(row)
    tracker.log({"event": "learner_rewind", "step": 3})
    tracker.close()
    tracker.log(ROWS[0])  # after close: ignored
    board = tmp_path / "tensorboard"
    assert _series(board, "train/reward_mean") == [(s, round(0.1 * s, 6)) for s in range(1, 6)]
    assert _series(board, "train/loss") == [(s, round(1.0 / s, 6)) for s in range(1, 6)]
    assert _series(board, "learner/grad_norm")[-1] == (5, 10.0)
    assert _series(board, "sync/total_ms")[0] == (1, 11.0)
    assert _series(board, "events/learner_rewind") == [(3, 1.0)]


def test_a_full_queue_drops_rows_for_the_trackers_only(tmp_path: Path, monkeypatch) -> None:
    tracker = Tracker(tmp_path, TrackingSettings(queue_size=1), run_name="grpo-test")
    gate, entered = threading.Event(), threading.Event()
    writer = tracker._writers[0]
    original = writer.add_scalar

    def held(*args, **kwargs):
        entered.set()
        gate.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(writer, "add_scalar", held)
    tracker.log(ROWS[0])
    assert entered.wait(30)  # the writer thread holds row 1
    tracker.log(ROWS[1])  # fills the queue
    tracker.log(ROWS[2])  # dropped
    assert tracker.dropped == 1
    gate.set()
    tracker.close()


def test_weights_and_biases_offline(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    settings = TrackingSettings(tensorboard=False, wandb_project="grpo-test", wandb_mode="offline")
    tracker = Tracker(tmp_path, settings, run_name="grpo-offline", config={"group_size": 4})
    for row in ROWS[:3]:
        tracker.log(row)
    tracker.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    files = list(runs[0].glob("*.wandb"))
    assert files and files[0].stat().st_size > 0
