"""Event-loop lag: how late a periodic task wakes up, measured in every service.

A task sleeps `interval` seconds in a loop and records how much later than asked it woke. Anything
that blocks the loop (a model step, tokenization, O(tokens) conversion on the loop) shows up here as
lag, so "the loop is never blocked" is measured rather than assumed. Every `report_every` seconds the
window's statistics are logged as one structured line (`event loop lag`, warning level when the worst
lag passed `warn_ms`) and kept in `last_report` for tests and status views.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.common.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class LagReport:
    """Lag statistics of one reporting window (milliseconds)."""

    samples: int
    mean_ms: float
    max_ms: float


class LoopLagMonitor:
    """Measures the lag of the running event loop; `start()` inside the loop, `await stop()`."""

    def __init__(
        self,
        interval: float = 0.1,
        report_every: float = 30.0,
        warn_ms: float = 100.0,
        observe: Callable[[float], None] | None = None,
    ) -> None:
        self.interval = interval
        self._observe = observe  # each lag in seconds (e.g. a Prometheus histogram)
        self.report_every = report_every
        self.warn_ms = warn_ms
        self.last_report: LagReport | None = None
        self._lags: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def report(self) -> LagReport:
        """Statistics since the previous report, logged; the window restarts."""
        lags, self._lags = self._lags, []
        report = LagReport(
            samples=len(lags),
            mean_ms=sum(lags) / len(lags) if lags else 0.0,
            max_ms=max(lags, default=0.0),
        )
        self.last_report = report
        emit = log.warning if report.max_ms > self.warn_ms else log.info
        emit(
            "event loop lag",
            samples=report.samples,
            mean_ms=round(report.mean_ms, 2),
            max_ms=round(report.max_ms, 2),
        )
        return report

    async def _run(self) -> None:
        window_start = time.perf_counter()
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(self.interval)
            woke = time.perf_counter()
            lag_ms = max(0.0, (woke - asked - self.interval) * 1e3)
            self._lags.append(lag_ms)
            if self._observe is not None:
                self._observe(lag_ms / 1e3)
            if woke - window_start >= self.report_every:
                self.report()
                window_start = woke
