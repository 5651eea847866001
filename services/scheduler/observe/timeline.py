"""The run as a timeline (`[scheduler] trace = true`): where each step's time goes, and what overlaps.

`metrics.jsonl` says how long each phase took per step; it cannot show what ran at the same time
(was the learner waiting for a batch, or the rollouts for a commit?). With `trace` on, the scheduler
writes `<run_dir>/trace.json` in the Chrome trace-event format, which https://ui.perfetto.dev and
chrome://tracing open:

    learner            each TrainStep (step, version, groups); the gaps are the learner waiting
    weight sync        each version's prepare (the learner packs it), stage (all rollouts), commit
                       (its end: the rollouts generate on it) and the rollouts' alignment probe
    evaluate           each held-out evaluation
    generate <rollout> every group's Generate on that rollout (async slices: concurrent groups stack)
    score              every group's scoring by the environment

Times are the scheduler's `time.perf_counter()` (a span is the RPC as the scheduler awaited it,
network included), in microseconds from when recording started. Recording an event costs the event
loop a tuple and a queue put; a writer thread encodes and writes them. The file is a JSON array
written as it goes (the trace-event format lets its `]` be missing, as after a crash); `close()`
ends it, so a finished run's trace is plain JSON. A scheduler restarted on the run directory starts
the file again. After `max_events` spans nothing more is recorded, and one log line says so.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.common.logging import get_logger

log = get_logger(__name__)

LEARNER = "learner"
SYNC = "weight sync"
EVALUATE = "evaluate"
SCORE = "score"
MAX_EVENTS = 1_000_000  # spans: ≤ ~320 MB of JSON (~160 B a record, two for a group's); the demo: 37 a step

# (phase, track, name, start_s, end_s, args, async_id)
_Event = tuple[str, str, str, float, float, dict[str, Any], str]


class Timeline:
    """Spans of the run written as trace events by a thread of its own; a no-op until `open`."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.path: Path | None = None
        self.max_events = max_events
        self.recorded = 0
        self._origin = time.perf_counter()
        self._queue: queue.SimpleQueue[_Event | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def open(self, path: Path) -> None:
        """Start recording into `path` (replaced), its times counted from now."""
        self.close()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.recorded, self._origin = path, 0, time.perf_counter()
        self._file = path.open("w", encoding="utf-8")
        self._thread = threading.Thread(target=self._write, name="timeline", daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        return self._thread is not None and self.recorded < self.max_events

    def span(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        """A span on `track` (spans of one track do not overlap: a lane such as the learner's)."""
        self._record(("X", track, name, start, end, args, ""))

    def async_span(self, track: str, name: str, key: str, start: float, end: float, **args: Any) -> None:
        """A span on `track` that may overlap others there (`key` tells them apart: a group id)."""
        self._record(("b", track, name, start, end, args, key))

    @contextlib.contextmanager
    def timed(self, track: str, name: str, **args: Any) -> Iterator[None]:
        """`span` around a block."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.span(track, name, start, time.perf_counter(), **args)

    def _record(self, event: _Event) -> None:
        if not self.enabled:
            return
        self.recorded += 1
        self._queue.put(event)
        if self.recorded == self.max_events:
            log.warning("trace: event limit reached, nothing more is recorded", path=str(self.path))

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, end the JSON array and the thread (idempotent)."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        self._thread = None

    # ---- writer thread ----------------------------------------------------------------------

    def _write(self) -> None:
        tracks: dict[str, int] = {}
        with self._file as out:
            out.write("[" + json.dumps(_meta("process_name", 0, "grpo-mesh scheduler")))
            while (event := self._queue.get()) is not None:
                phase, track, name, start, end, args, key = event
                tid = tracks.get(track)
                if tid is None:
                    tid = tracks[track] = len(tracks) + 1
                    out.write(",\n" + json.dumps(_meta("thread_name", tid, track)))
                    out.write(",\n" + json.dumps(_meta("thread_sort_index", tid, tid)))
                for record in self._encode(phase, tid, name, start, end, args, key, track):
                    out.write(",\n" + json.dumps(record))
                if self._queue.empty():
                    out.flush()  # a live run's trace can be opened as it grows
            out.write("\n]\n")

    def _encode(
        self, phase: str, tid: int, name: str, start: float, end: float, args: dict, key: str, track: str
    ) -> list[dict[str, Any]]:
        ts, dur = (start - self._origin) * 1e6, max(0.0, end - start) * 1e6
        common = {"name": name, "pid": 1, "tid": tid, "args": args}
        if phase == "X":
            return [{**common, "ph": "X", "ts": round(ts, 1), "dur": round(dur, 1)}]
        # nestable async slices: Perfetto stacks the overlapping ones of a track into rows
        ids = {"cat": track, "id2": {"local": key}}
        return [
            {**common, **ids, "ph": "b", "ts": round(ts, 1)},
            {**ids, "name": name, "pid": 1, "tid": tid, "ph": "e", "ts": round(ts + dur, 1)},
        ]


def _meta(kind: str, tid: int, value: Any) -> dict[str, Any]:
    key = "sort_index" if kind == "thread_sort_index" else "name"
    return {"name": kind, "ph": "M", "pid": 1, "tid": tid, "args": {key: value}}
