"""TensorBoard and W&B tracking of a run: the tag mapping, event files read back, a full queue, W&B offline
(its `.wandb` file read back record by record)."""

from __future__ import annotations

import math
import sys
import threading
import time
from pathlib import Path

import pydantic
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from services.scheduler.observe import tracking
from services.scheduler.observe.tracking import Tracker, TrackingSettings, scalars, wandb_run_id

ROWS = [
    {
        "step": s,
        "weight_version": s,
        "reward_mean": 0.25 * s,
        "loss": 1.0 / s,
        "learner/loss": 2.0 * s,
        "sync_ms": 10.0 + s,
        "sync_stage_ms": 4.0,
        "staleness_max": 1,
        "retrained": False,
        "behaviour_versions": [s - 1],
        "weight_transport": "grpc_stream",
        "time": 1.7e9 + s,
    }
    for s in range(1, 6)
]
EVENT = {"event": "learner_rewind", "step": 3, "weight_version": 3, "steps_to_retrain": 2}
EVAL = {
    "step": 5,
    "weight_version": 5,
    "eval_only": True,
    "eval/accuracy": 0.75,
    "eval/prompts_requested": 8.0,
}


def test_scalars_name_keys_by_group_and_skip_what_is_not_a_finite_number() -> None:
    row = {**ROWS[0], "loss": math.nan, "tokens_per_s": math.inf, "eval_error": "x", "missing": None}
    assert scalars(row) == (
        1,
        {
            "train/weight_version": 1.0,
            "train/reward_mean": 0.25,
            "learner/loss": 2.0,
            "sync/total_ms": 11.0,
            "sync/stage_ms": 4.0,
            "staleness/max": 1.0,
        },
    )
    assert scalars({"step": "7", "sync_prepare_ms": 1, "staleness_mean": 0.5, "filtered_fraction": 0}) == (
        7,
        {"sync/prepare_ms": 1.0, "staleness/mean": 0.5, "train/filtered_fraction": 0.0},
    )
    assert scalars(EVAL) == (
        5,
        {"train/weight_version": 5.0, "eval/accuracy": 0.75, "eval/prompts_requested": 8.0},
    )
    assert scalars(EVENT) == (3, {"events/learner_rewind": 1.0})
    assert scalars({"event": "scheduler_restart"}) is None
    assert scalars({"reward_mean": 1.0}) is None


def test_settings_reject_unknown_fields_and_an_empty_queue() -> None:
    with pytest.raises(pydantic.ValidationError):
        TrackingSettings(tensorbord=False)
    with pytest.raises(pydantic.ValidationError):
        TrackingSettings(queue_size=0)
    with pytest.raises(pydantic.ValidationError):
        TrackingSettings(wandb_mode="disabled")


def test_wandb_run_id_is_stable_and_valid() -> None:
    assert wandb_run_id("grpo-0123abcd") == "grpo-0123abcd"
    odd = wandb_run_id("grpo/run: 1?")
    assert odd == wandb_run_id("grpo/run: 1?") != wandb_run_id("grpo/run: 2?")
    assert odd.startswith("grpo-run--1--") and not set(odd) & set(":;,#?/' ")


def _series(directory: Path, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_tensorboard_event_files_hold_the_run(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, TrackingSettings(), run_name="grpo-test")
    assert tracker.enabled
    for row in [*ROWS[:3], EVENT, *ROWS[3:], EVAL]:
        tracker.log(row)
    tracker.close()
    tracker.close()  # idempotent
    tracker.log(ROWS[0])  # after close: ignored
    board = tmp_path / "tensorboard"
    assert _series(board, "train/reward_mean") == [(s, 0.25 * s) for s in range(1, 6)]
    assert _series(board, "learner/loss") == [(s, 2.0 * s) for s in range(1, 6)]
    assert _series(board, "sync/total_ms") == [(s, 10.0 + s) for s in range(1, 6)]
    assert _series(board, "events/learner_rewind") == [(3, 1.0)]
    assert _series(board, "eval/accuracy") == [(5, 0.75)]
    assert [round(e.wall_time) for e in EventAccumulator(str(board)).Reload().Scalars("train/loss")] == [
        round(1.7e9 + s) for s in range(1, 6)
    ]  # the row's own time, not when the thread wrote it
    assert tracker.dropped == 0
    assert not tracker._thread.is_alive()


def test_without_trackers_there_is_no_thread_and_nothing_is_written(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, TrackingSettings(tensorboard=False), run_name="grpo-test")
    assert not tracker.enabled and tracker._thread is None
    tracker.log(ROWS[0])
    tracker.close()
    assert list(tmp_path.iterdir()) == []


class _Warnings:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    def warning(self, event: str, **fields) -> None:
        self.calls.append({"event": event, **fields})


@pytest.fixture
def held_tracker(tmp_path: Path, monkeypatch):
    """A Tracker (queue of 1) whose writer thread is stuck inside its first row until `gate` is set."""
    warnings = _Warnings()
    monkeypatch.setattr(tracking, "log", warnings)
    tracker = Tracker(tmp_path, TrackingSettings(queue_size=1), run_name="grpo-test")
    gate, entered = threading.Event(), threading.Event()
    add_event = tracker._board.add_event

    def held(event):
        entered.set()
        assert gate.wait(30)
        return add_event(event)

    monkeypatch.setattr(tracker._board, "add_event", held)
    tracker.log(ROWS[0])
    assert entered.wait(30)  # the writer thread holds row 1: the queue is empty again
    yield tracker, gate, warnings
    gate.set()
    tracker.close()


def test_a_full_queue_drops_rows_for_the_trackers_and_counts_them(held_tracker, tmp_path: Path) -> None:
    tracker, gate, warnings = held_tracker
    tracker.log(ROWS[1])  # fills the queue
    started = time.perf_counter()
    for _ in range(250):
        tracker.log(ROWS[2])  # dropped, without waiting
    assert time.perf_counter() - started < 1.0
    assert tracker.dropped == 250
    assert [w["dropped"] for w in warnings.calls] == [1, 101, 201]  # once per 100 drops
    gate.set()
    tracker.close()
    assert _series(tmp_path / "tensorboard", "train/reward_mean") == [(1, 0.25), (2, 0.5)]


def test_close_waits_at_most_its_timeout_for_a_stuck_writer(held_tracker) -> None:
    tracker, gate, warnings = held_tracker
    tracker.log(ROWS[1])  # the queue is full: close cannot even queue its stop sign
    started = time.perf_counter()
    tracker.close(timeout=0.2)
    assert time.perf_counter() - started < 2.0
    assert tracker._thread.is_alive()
    assert warnings.calls[-1]["event"] == "tracking writer did not finish in time"
    gate.set()
    tracker._thread.join(10)  # once unstuck, it drains the queue and stops by itself
    assert not tracker._thread.is_alive()


def test_wandb_missing_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    settings = TrackingSettings(tensorboard=False, wandb_project="t")
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[wandb\]'"):
        Tracker(tmp_path, settings, run_name="grpo-test")


def _wandb_records(path: Path):
    """The records of a `.wandb` file: a 7-byte header (":W&B", magic, version), then LevelDB-log
    records in 32 KiB blocks (crc32 4, length 2 little-endian, type 1: full/first/middle/last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunk = 7, b""
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:  # a block's tail too short for a header: padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb-core writes names as nested_key


def test_weights_and_biases_offline(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    settings = TrackingSettings(tensorboard=False, wandb_project="t", wandb_mode="offline")
    tracker = Tracker(tmp_path, settings, run_name="grpo-offline", config={"group_size": 4})
    for row in [*ROWS[:3], EVENT, {**ROWS[2], "retrained": True}]:  # step 3 again, as after a rewind
        tracker.log(row)
    tracker.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*-grpo-offline"))
    assert len(runs) == 1
    files = list(runs[0].glob("*.wandb"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    records = list(_wandb_records(files[0]))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.run_id, run.display_name, run.project) == ("grpo-offline", "grpo-offline", "t")
    assert "group_size" in {_key(item) for item in run.config.update}
    history = [
        {_key(item): float(item.value_json) for item in r.history.item if not _key(item).startswith("_")}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["step"], h.get("train/reward_mean"), h.get("events/learner_rewind")) for h in history] == [
        (1, 0.25, None),
        (2, 0.5, None),
        (3, 0.75, None),
        (3, None, 1.0),
        (3, 0.75, None),  # W&B's own step only grows: with `step` as the x axis nothing is dropped
    ]
