"""Telling a peer that stood still from the scheduler itself standing still.

A call's deadline runs on the wall clock. When the scheduler's own process is stopped (SIGSTOP, a
swap storm, a paused VM or container), every call it had in flight runs past its deadline while the
peers answered in time: on waking, a rollout's stage, probe or health poll fails with
DEADLINE_EXCEEDED although nothing is wrong with the rollout. Taking it out of work for that would
throw away its groups in flight.

`PauseWatch` ticks every `tick_s` on the scheduler's event loop; a tick that comes more than
`threshold_s` late means the process (or its loop) stood still for that long. `stood_still_since(t)`
says whether that happened since `t` (a failed call's start), including right now, before the late
tick has even run: on waking, the loop may run the failed calls' callbacks first.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

_KEEP_S = 3600.0  # pauses remembered (no call is older than its deadline, at most an hour)


class PauseWatch:
    def __init__(self, tick_s: float = 0.25, threshold_s: float = 1.0) -> None:
        self.tick_s, self.threshold_s = tick_s, threshold_s
        self._last_tick = time.monotonic()
        self.running = False  # not watching: nothing is attributed to a pause
        self.pauses: deque[tuple[float, float]] = deque()  # (start, end), monotonic

    async def run(self) -> None:
        """Tick until cancelled (a background task of the scheduler)."""
        self._last_tick, self.running = time.monotonic(), True
        try:
            while True:
                before = time.monotonic()
                await asyncio.sleep(self.tick_s)
                self.tick(before)
        finally:
            self.running = False

    def tick(self, slept_since: float) -> None:
        now = time.monotonic()
        if now - slept_since > self.tick_s + self.threshold_s:
            self.pauses.append((slept_since, now))
        while self.pauses and now - self.pauses[0][1] > _KEEP_S:
            self.pauses.popleft()
        self._last_tick = now

    def stood_still_since(self, started: float) -> bool:
        """Whether this process stood still at some time since `started` (monotonic), now included."""
        if not self.running:
            return False
        if time.monotonic() - self._last_tick > self.tick_s + self.threshold_s:
            return True  # waking up from a pause: the late tick has not run yet
        return any(end >= started for _, end in self.pauses)
