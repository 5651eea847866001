"""services/common/loop_lag.py: a blocked event loop shows up as lag; an idle one does not."""

from __future__ import annotations

import asyncio
import time

from services.common.loop_lag import LoopLagMonitor


async def test_blocking_the_loop_is_measured_as_lag() -> None:
    monitor = LoopLagMonitor(interval=0.01, report_every=3600)
    monitor.start()
    try:
        await asyncio.sleep(0.1)
        idle = monitor.report()
        time.sleep(0.25)  # what a model step on the event loop would do  # noqa: ASYNC251
        await asyncio.sleep(0.05)
        blocked = monitor.report()
    finally:
        await monitor.stop()
    assert idle.samples >= 3 and idle.max_ms < 100
    assert blocked.max_ms >= 150 and monitor.last_report is blocked


async def test_a_report_is_taken_every_window() -> None:
    monitor = LoopLagMonitor(interval=0.01, report_every=0.05, warn_ms=1e9)
    monitor.start()
    await asyncio.sleep(0.2)
    await monitor.stop()
    assert monitor.last_report is not None and monitor.last_report.samples >= 1
