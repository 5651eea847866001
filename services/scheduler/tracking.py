"""A run's curves for TensorBoard and (optionally) Weights & Biases, written off the event loop.

Every row the scheduler writes to `metrics.jsonl` is also handed to `Tracker.log`, which only puts
it on a bounded queue; a writer thread turns it into scalars. Rows beyond the queue are dropped for
the trackers (never for metrics.jsonl, the run's record) and counted.

Scalar names (`scalars`): the row's `step` is the x axis; every finite int/float value (not bools,
lists or strings) becomes a scalar. Keys that already name a group keep it (`learner/loss`,
`eval/...`); `sync_*` become `sync/*` (`sync_ms` → `sync/total_ms`), `staleness_*` become
`staleness/*`, everything else `train/<key>`. An event row (`{"event": "learner_rewind", ...}`)
becomes a marker `events/<name>` = 1 at its step.

    tensorboard --logdir <run_dir>/tensorboard
"""

from __future__ import annotations

import math
import queue
import threading
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.logging import get_logger

log = get_logger(__name__)

_SKIP = ("step", "time")


class TrackingSettings(BaseModel):
    """`--tracking.*`: where the run's curves go besides metrics.jsonl."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensorboard: bool = Field(
        default=True,
        description="TensorBoard event files in <run_dir>/tensorboard (tensorboard --logdir).",
    )
    wandb_project: str = Field(
        default="", description="Weights & Biases project; empty = off (needs the `wandb` extra)."
    )
    wandb_mode: Literal["online", "offline"] = Field(
        default="online",
        description="offline: the W&B run is written under <run_dir>/wandb, no network (`wandb sync` later).",
    )
    queue_size: int = Field(
        default=1024, ge=1, description="Rows waiting for the writer thread; beyond it they are dropped."
    )


def _tag(key: str) -> str:
    if "/" in key:
        return key
    if key == "sync_ms":
        return "sync/total_ms"
    for prefix in ("sync_", "staleness_"):
        if key.startswith(prefix):
            return f"{prefix[:-1]}/{key[len(prefix) :]}"
    return f"train/{key}"


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(step, {tag: value}) of one metrics row, or None when it has no step."""
    if "step" not in record:
        return None
    step = int(record["step"])
    if "event" in record:
        return step, {f"events/{record['event']}": 1.0}
    values = {}
    for key, value in record.items():
        if key in _SKIP or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            values[_tag(key)] = float(value)
    return step, values


class Tracker:
    """Hands rows to TensorBoard / W&B on a thread of its own. `log` never blocks."""

    def __init__(
        self, run_dir: Path, settings: TrackingSettings, run_name: str, config: dict | None = None
    ) -> None:
        self.settings = settings
        self.dropped = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(settings.queue_size)
        self._closed = False
        self._writers: list[Any] = []
        if settings.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writers.append(SummaryWriter(log_dir=str(run_dir / "tensorboard")))
        self._wandb = None
        if settings.wandb_project:
            try:
                import wandb
            except ImportError as exc:
                raise RuntimeError(
                    "--tracking.wandb-project needs Weights & Biases: pip install -e '.[wandb]'"
                ) from exc
            self._wandb = wandb.init(
                project=settings.wandb_project,
                name=run_name,
                id=run_name,  # stable: a restarted scheduler continues the same W&B run
                resume="allow",
                dir=str(run_dir),
                mode=settings.wandb_mode,
                config=config or {},
            )
        self._thread: threading.Thread | None = None
        if self.enabled:
            self._thread = threading.Thread(target=self._write_rows, name="tracking", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return bool(self._writers) or self._wandb is not None

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled or self._closed:
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1
            if self.dropped % 100 == 1:
                log.warning("tracking queue full: rows dropped for TensorBoard/W&B", dropped=self.dropped)

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
        for writer in self._writers:
            writer.close()
        if self._wandb is not None:
            self._wandb.finish()

    def _write_rows(self) -> None:
        while (record := self._queue.get()) is not None:
            parsed = scalars(record)
            if parsed is None:
                continue
            step, values = parsed
            try:
                for writer in self._writers:
                    for tag, value in values.items():
                        writer.add_scalar(tag, value, step)
                    writer.flush()
                if self._wandb is not None and values:
                    self._wandb.log(values, step=step)
            except Exception as exc:  # a tracker problem must never stop the run
                log.warning("tracking write failed", error=str(exc))
