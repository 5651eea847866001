"""Per-step run metrics (one JSON object per optimizer step appended to `<run_dir>/metrics.jsonl`) and
the scheduler's per-step Prometheus histograms."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import Histogram

from services.scheduler.observe.tracking import Tracker
from services.scheduler.peers.clients import ScoredGroup, StepResult

REQUIRED_KEYS = (
    "step",
    "weight_version",
    "reward_mean",
    "loss",
    "staleness_mean",
    "sync_ms",
    "logprob_abs_diff_max",
    "tokens_per_s",
)


STEP_RATE_WINDOW_S = 60.0

# Per-step Prometheus histograms (the gauges come from SchedulerApp.metrics_snapshot).
SYNC_SECONDS = Histogram(
    "grpo_scheduler_sync_seconds",
    "Weight sync duration after each step, by phase (prepare, stage, commit, total).",
    ["phase"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TRAIN_SECONDS = Histogram(
    "grpo_scheduler_train_seconds",
    "TrainStep duration as the scheduler saw it.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180, 600),
)
STALENESS = Histogram(
    "grpo_scheduler_group_staleness",
    "Versions between a trained group's oldest token and the step that trained it.",
    buckets=(0, 1, 2, 3, 4, 6, 8, 16),
)


def observe_step(record: dict[str, Any], staleness: Sequence[int]) -> None:
    """Feed one step row into the histograms."""
    for phase in ("prepare", "stage", "commit"):
        SYNC_SECONDS.labels(phase).observe(record.get(f"sync_{phase}_ms", 0.0) / 1e3)
    SYNC_SECONDS.labels("total").observe(record.get("sync_ms", 0.0) / 1e3)
    if "train_ms" in record:
        TRAIN_SECONDS.observe(record["train_ms"] / 1e3)
    for value in staleness:
        STALENESS.observe(value)


class MetricsLog:
    """Appends one line per step and flushes it, so a crash loses at most the current step. Keeps the
    last step row and the recent step times for GetStatus."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        self.last_step = _last_step(self.path)  # of an earlier incarnation's rows (a restart appends)
        self.last_record: dict[str, Any] = {}  # the newest step row this process wrote
        self._step_times: deque[float] = deque(maxlen=10_000)  # monotonic time of each step row
        self._file = self.path.open("a", encoding="utf-8")
        self.tracker: Tracker | None = None  # TensorBoard / W&B (tracking.py), once the run is known

    def attach(self, tracker: Tracker) -> None:
        """From now on every row also goes to `tracker` (opened once the run's id is known)."""
        self.tracker = tracker

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        clean.setdefault("time", time.time())
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()
        if self.tracker is not None:
            self.tracker.log(clean)
        if is_step_row(record):
            self.last_step = max(self.last_step, int(record["step"]))
            self.last_record = record
            self._step_times.append(time.monotonic())

    def status_fields(self) -> dict[str, Any]:
        """The GetStatus fields taken from the last step row: reward, loss, rates, sync phases (a
        `recovered` row, written from the ledger after a restart, has no loss: 0 until the next)."""
        last = self.last_record
        if not last:
            return {}
        loss = last.get("loss")
        return {
            "reward_mean": last["reward_mean"],
            "loss": loss if isinstance(loss, float) and math.isfinite(loss) else 0.0,
            "steps_per_second": self.steps_per_second(),
            "tokens_per_second": last.get("tokens_per_s", 0.0),
            "sync_ms": tuple(
                last.get(k, 0.0) for k in ("sync_prepare_ms", "sync_stage_ms", "sync_commit_ms", "sync_ms")
            ),
        }

    def steps_per_second(self, window: float = STEP_RATE_WINDOW_S) -> float:
        """Step rows written per second over the last `window` seconds (0 with fewer than two)."""
        now = time.monotonic()
        recent = [t for t in self._step_times if now - t <= window]
        if len(recent) < 2:
            return 0.0
        return (len(recent) - 1) / max(recent[-1] - recent[0], 1e-9)

    def close(self) -> None:
        self._file.close()
        if self.tracker is not None:
            self.tracker.close()


def is_step_row(row: dict[str, Any]) -> bool:
    """A training step's row (not an evaluation-only row, nor an event such as `recovered`)."""
    return "reward_mean" in row and "event" not in row


def _last_step(path: Path) -> int:
    """The newest step row of an existing metrics file (0 when there is none)."""
    last = 0
    if path.exists():
        with path.open(encoding="utf-8") as rows:
            for line in rows:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if is_step_row(row):
                    last = max(last, int(row["step"]))
    return last


class TokenRate:
    """Completion tokens generated per second between two reads."""

    def __init__(self) -> None:
        self._tokens = 0
        self._since = time.perf_counter()

    def add(self, tokens: int) -> None:
        self._tokens += tokens

    def take(self) -> float:
        now = time.perf_counter()
        rate = self._tokens / max(now - self._since, 1e-9)
        self._tokens, self._since = 0, now
        return rate


def episode_record(groups: Sequence[ScoredGroup]) -> dict[str, float]:
    """A multi-turn step's episode figures: tool-call rate (episodes with at least one call) and valid
    tool-call rate (with at least one call that ran without error), calls and failed calls per
    episode, model turns per episode, failed episodes, environment tokens."""
    stats = [g.stats for g in groups if g.stats]
    if not stats:
        return {}
    total = {key: math.fsum(s.get(key, 0.0) for s in stats) for key in stats[0]}
    episodes = max(1.0, total["episodes"])
    return {
        "episode/tool_call_rate": total["episodes_with_tool_calls"] / episodes,
        "episode/valid_tool_call_rate": total.get("episodes_with_valid_calls", 0.0) / episodes,
        "episode/tool_calls_mean": total["tool_calls"] / episodes,
        "episode/tool_errors_mean": total["tool_errors"] / episodes,
        "episode/turns_mean": total["model_turns"] / episodes,
        "episode/failures": total["failures"],
        "episode/env_tokens_mean": total["env_tokens"] / episodes,
    }


def step_record(
    groups: Sequence[ScoredGroup], staleness: Sequence[int], result: StepResult, **extra: Any
) -> dict[str, Any]:
    """One optimizer step's metrics row: rewards, staleness, the learner's metrics (as `learner/<name>`)
    and whatever the caller adds (the sync's phases: `SyncResult.record()`)."""
    rewards = [r for g in groups for r in g.rewards]
    reward_mean = statistics.fmean(rewards)
    return episode_record(groups) | {
        "step": result.step,
        "weight_version": result.weight_version,
        "reward_mean": reward_mean,
        "reward_std": math.sqrt(math.fsum((r - reward_mean) ** 2 for r in rewards) / len(rewards)),
        "loss": result.metrics.get("loss", float("nan")),
        "staleness_mean": statistics.fmean(staleness),
        "staleness_max": max(staleness),
        "behaviour_versions": sorted(set().union(*(g.versions for g in groups))),
        **extra,
        **{f"learner/{k}": v for k, v in result.metrics.items()},
    }
