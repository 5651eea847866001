"""A run's curves in TensorBoard and (optionally) Weights & Biases, written off the event loop.

`metrics.jsonl` is the run's record; this module draws its curves. Every row `MetricsLog.write`
appends is also handed to `Tracker.log`, which runs on the asyncio event loop and so only parses the
row and puts it on a bounded queue: a writer thread does all the disk and network work. Rows beyond
the queue are dropped for the trackers (never for metrics.jsonl) and counted in `Tracker.dropped`.

Scalar names (`scalars`): the row's `step` is the x axis; every finite int/float value (not bools,
lists, strings, None, NaN or inf) becomes a scalar, so new keys show up without touching this file.

    learner/loss, eval/accuracy   keys that already name a group keep it
    sync_ms, sync_stage_ms        sync/total_ms, sync/stage_ms      (the weight sync's phases together)
    staleness_mean                staleness/mean
    reward_mean, tokens_per_s     train/reward_mean, train/tokens_per_s   (every other plain key)
    step, time                    not scalars (the x axis; the wall time of the TensorBoard event)
    {"event": "learner_rewind"}   events/learner_rewind = 1 at the row's step: a marker on the chart

W&B gets the same names with `step` as a metric of its own (`define_metric`): W&B's built-in step
must only grow, so steps trained again after a learner rewind would otherwise be dropped silently.

    tensorboard --logdir <run_dir>/tensorboard
    wandb sync <run_dir>/wandb/offline-run-*      (after --tracking.wandb-mode offline)
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.logging import get_logger

log = get_logger(__name__)

_NOT_SCALARS = ("step", "time")
_IDLE_POLL_S = 0.5  # how often an idle writer thread looks whether close() was called
_WARN_EVERY = 100  # one warning per this many dropped rows

Row = tuple[int, dict[str, float], float]  # step, {tag: value}, wall time


class TrackingSettings(BaseModel):
    """`--tracking.*`: where the run's curves go besides metrics.jsonl."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensorboard: bool = Field(
        default=True,
        description="Write TensorBoard event files under <run_dir>/tensorboard; view them with "
        "`tensorboard --logdir <run_dir>/tensorboard`.",
    )
    wandb_project: str = Field(
        default="",
        description="Weights & Biases project to log the run to; empty = off. Needs the optional `wandb` "
        "extra: pip install -e '.[wandb]'.",
    )
    wandb_mode: Literal["online", "offline"] = Field(
        default="online",
        description="offline: the W&B run is written under <run_dir>/wandb without a network; "
        "`wandb sync` uploads it later.",
    )
    queue_size: int = Field(
        default=1024,
        ge=1,
        description="Rows waiting for the writer thread; beyond it rows are dropped for TensorBoard/W&B "
        "(never for metrics.jsonl) and counted.",
    )


def _tag(key: str) -> str:
    if "/" in key:
        return key
    if key == "sync_ms":
        return "sync/total_ms"
    for group in ("sync", "staleness"):
        if key.startswith(group + "_"):
            return f"{group}/{key[len(group) + 1 :]}"
    return f"train/{key}"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(step, {tag: value}) of one metrics row, or None when it has no step to plot it at."""
    if record.get("step") is None:
        return None
    step = int(record["step"])
    if "event" in record:
        return step, {f"events/{record['event']}": 1.0}
    return step, {_tag(k): float(v) for k, v in record.items() if k not in _NOT_SCALARS and _number(v)}


def wandb_run_id(run_name: str) -> str:
    """A W&B run id that is the same for the same run name, so a restarted scheduler resumes its run.
    The name itself when W&B accepts it (and it is a safe file name), else a cleaned name plus a hash."""
    if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", run_name):
        return run_name
    digest = hashlib.sha256(run_name.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', run_name)[:55]}-{digest}"


class Tracker:
    """Hands metrics rows to TensorBoard and W&B on a thread of its own; `log` never blocks.

    The constructor opens the writers (a file; `wandb.init`, which in online mode may wait on the
    network), so errors in the settings surface at start-up. Without any writer there is no thread.
    """

    def __init__(
        self, run_dir: Path, settings: TrackingSettings, run_name: str, config: dict | None = None
    ) -> None:
        self.settings = settings
        self.dropped = 0  # rows the full queue turned away
        self._queue: queue.Queue[Row | None] = queue.Queue(settings.queue_size)
        self._closed = False
        self._stop = threading.Event()
        self._board: Any = None  # tensorboard's EventFileWriter
        self._wandb: Any = None  # the wandb Run
        if settings.tensorboard:
            # tensorboard's own writer, not torch.utils.tensorboard: the scheduler does not load torch.
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self._board = EventFileWriter(str(run_dir / "tensorboard"))
        if settings.wandb_project:
            self._wandb = _wandb_init(run_dir, settings, run_name, config)
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._write_rows, name="tracking", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        """Whether any tracker is on (False: `log` and `close` do nothing)."""
        return self._board is not None or self._wandb is not None

    def log(self, record: dict[str, Any]) -> None:
        """Queue one metrics row for the writer thread; a no-op when disabled or closed."""
        if not self.enabled or self._closed:
            return
        parsed = scalars(record)
        if parsed is None or not parsed[1]:
            return
        wall_time = record.get("time")
        row = (*parsed, float(wall_time) if _number(wall_time) else time.time())
        try:
            self._queue.put_nowait(row)
        except queue.Full:
            self.dropped += 1
            if self.dropped % _WARN_EVERY == 1:
                log.warning("tracking queue full: rows dropped for TensorBoard/W&B", dropped=self.dropped)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, close the writers and end the thread, waiting at most `timeout`
        seconds (a writer stuck on the network is left behind, as a daemon thread). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        self._stop.set()
        with contextlib.suppress(queue.Full):  # a full queue: the thread stops once it drains it
            self._queue.put_nowait(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "tracking writer did not finish in time", timeout_s=timeout, queued=self._queue.qsize()
            )

    def _write_rows(self) -> None:
        """The writer thread: rows until close() (then the queue drained), then the writers closed."""
        while True:
            try:
                row = self._queue.get(timeout=_IDLE_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    break
                continue
            if row is None:
                break
            try:
                self._write(*row)
            except Exception as exc:  # a tracker's trouble must never stop the run
                log.warning("tracking write failed", step=row[0], error=str(exc))
        for name, finish in (("tensorboard", self._close_board), ("wandb", self._finish_wandb)):
            try:
                finish()
            except Exception as exc:
                log.warning("tracking close failed", tracker=name, error=str(exc))

    def _write(self, step: int, values: dict[str, float], wall_time: float) -> None:
        if self._board is not None:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=t, simple_value=v) for t, v in values.items()])
            self._board.add_event(Event(wall_time=wall_time, step=step, summary=summary))
            if self._queue.empty():  # one flush per burst
                self._board.flush()
        if self._wandb is not None:
            self._wandb.log({**values, "step": step})

    def _close_board(self) -> None:
        if self._board is not None:
            self._board.close()

    def _finish_wandb(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_init(run_dir: Path, settings: TrackingSettings, run_name: str, config: dict | None) -> Any:
    """Start (or resume) the run's W&B run, with `step` as the x axis of every chart."""
    try:
        import wandb
    except ImportError as exc:
        raise RuntimeError(
            "--tracking.wandb-project needs Weights & Biases, an optional extra: pip install -e '.[wandb]'"
        ) from exc
    run = wandb.init(
        project=settings.wandb_project,
        name=run_name,
        id=wandb_run_id(run_name),
        resume="allow",
        dir=str(run_dir),
        mode=settings.wandb_mode,
        config=config or {},
    )
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run
