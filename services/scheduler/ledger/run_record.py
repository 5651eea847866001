"""A run's state from its run directory alone, for a run whose scheduler is not running (finished,
stopped, crashed): the same GetStatus answer the live scheduler would give, rebuilt from the record.

    run.toml        max_steps, transport, group shape, source   ([scheduler] table)
    metrics.jsonl   the last step row: step, version, reward, loss, staleness, alignment, sync phases;
                    steps/s over the run's step rows
    ledger.sqlite   groups by state; how the run ended (read-only): the scheduler's `run_finished`,
                    `run_failed` (its error) or `run_stopped` event, none if it was killed

Nothing here writes to the run directory, and the ledger is opened read-only.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo.scheduler.v1 import scheduler_pb2
from services.scheduler.ledger.group_ledger import GroupState
from services.scheduler.ledger.recovery import ENDINGS, left_paused
from services.scheduler.ledger.store import FILE_NAME, read_ledger
from services.scheduler.observe.metrics import is_step_row


@dataclass(frozen=True)
class RunRecord:
    status: scheduler_pb2.GetStatusResponse
    ending: str  # "finished" | "failed" | "stopped" | "" (no ending recorded: killed, or still running)
    at: float  # time of the last record (epoch seconds; 0 unknown)


def has_record(run_dir: Path) -> bool:
    return (run_dir / "metrics.jsonl").exists() or (run_dir / FILE_NAME).exists()


def _step_rows(path: Path) -> list[dict[str, Any]]:
    """The step rows of metrics.jsonl (complete lines; evaluations and events left out)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").split("\n")[:-1]:  # the last one may be half written
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and is_step_row(row):
            rows.append(row)
    return rows


def _number(row: dict[str, Any], key: str) -> float:
    value = row.get(key)
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else 0.0


def _steps_per_second(rows: list[dict[str, Any]]) -> float:
    """Step rows per second from the first to the last (a restart's pause included)."""
    times = [_number(r, "time") for r in rows if _number(r, "time") > 0]
    if len(times) < 2 or times[-1] <= times[0]:
        return 0.0
    return (len(times) - 1) / (times[-1] - times[0])


def read_record(run_dir: Path) -> RunRecord:
    """The run's state from `run_dir` (FileNotFoundError when it holds no record of a run)."""
    if not has_record(run_dir):
        raise FileNotFoundError(f"{run_dir} holds no run record (metrics.jsonl or {FILE_NAME})")
    config_path = run_dir / "run.toml"
    config = tomllib.loads(config_path.read_text()).get("scheduler", {}) if config_path.exists() else {}
    status = scheduler_pb2.GetStatusResponse(
        max_steps=int(config.get("max_steps", 0)),
        weight_transport=str(config.get("weight_transport", "")),
        source=str(config.get("source", "")),
        group_size=int(config.get("group_size", 0)),
        groups_per_batch=int(config.get("groups_per_batch", 0)),
    )
    rows = _step_rows(run_dir / "metrics.jsonl")
    at = 0.0
    if rows:
        last = rows[-1]
        status.step, status.learner_version = int(last["step"]), int(last.get("weight_version", 0))
        status.reward_mean, status.loss = _number(last, "reward_mean"), _number(last, "loss")
        status.staleness_mean = _number(last, "staleness_mean")
        status.tokens_per_second = _number(last, "tokens_per_s")
        status.steps_per_second = _steps_per_second(rows)
        if isinstance(last.get("logprob_abs_diff_max"), int | float):
            status.logprob_abs_diff_max = float(last["logprob_abs_diff_max"])
        for phase in ("prepare", "stage", "commit"):
            setattr(status.last_sync, f"{phase}_ms", _number(last, f"sync_{phase}_ms"))
        status.last_sync.total_ms = _number(last, "sync_ms")
        first, at = _number(rows[0], "time"), _number(last, "time")
        status.uptime_seconds = max(at - first, 0.0)
    ending = ""
    if (run_dir / FILE_NAME).exists():
        snapshot = read_ledger(run_dir)
        counts = Counter(str(g.state) for g in snapshot.groups)
        status.groups_by_state.update({state.value: counts[state.value] for state in GroupState})
        # a step the ledger saw trained may have no metrics row yet (stopped in between); batch rows
        # count steps from 0
        status.step = max(status.step, max((t.step + 1 for t in snapshot.trainings), default=0))
        trained = max((t.version_after for t in snapshot.trainings), default=0)
        status.learner_version = max(status.learner_version, trained)
        for kind, when, detail in snapshot.events:
            if kind in ENDINGS:
                ending, at = kind.removeprefix("run_"), max(at, when)
                status.error = str(detail.get("error", "")) if kind == "run_failed" else ""
            elif kind == "scheduler_start":
                ending = ""  # a later incarnation started: an earlier ending is not the last word
        status.paused = not ending and left_paused(snapshot)  # killed while paused: a restart keeps it
    status.finished = ending in ("finished", "failed")
    return RunRecord(status, ending, at)
