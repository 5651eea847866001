"""Recording the calls that belong to a session (an episode): their exact tokens, logprobs and versions.

A call with an `X-Session-ID` is recorded once it is answered: the prompt's token ids as the engine
saw them, and for each choice the sampled token ids, their behaviour logprobs, the weight-version
spans and the finish reason, plus the episode's state (broken, and why) at that call. What a trainer
learns from is these tokens, never text an environment hands back.

`CallRecorder` is the seam: the standalone `JsonlRecorder` appends one JSON line per call to a file
(from a thread of its own, through a bounded queue: a full queue drops the record and counts it,
the event loop never waits on the disk); the scheduler plugs in its ledger-backed recorder.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class ChoiceRecord:
    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    # [version, start, end) spans of the choice's tokens
    version_spans: tuple[tuple[int, int, int], ...]
    finish_reason: str


@dataclass(frozen=True)
class CallRecord:
    session_id: str
    request_id: str
    route: str
    rollout_id: str
    prompt_token_ids: tuple[int, ...]
    choices: tuple[ChoiceRecord, ...]
    # "" while the episode is token-exact; else why it is broken (it must not be trained on)
    episode_broken: str = ""
    time: float = field(default_factory=time.time)


class CallRecorder(Protocol):
    """Where session calls go. `record` is called on the event loop and must not block."""

    def record(self, call: CallRecord) -> None: ...

    async def close(self) -> None:
        """Write out what is pending and release the resources."""


class NullRecorder:
    """Records nothing (no --record.path)."""

    dropped = 0
    written = 0

    def record(self, call: CallRecord) -> None:
        return None

    async def close(self) -> None:
        return None


_STOP = None


class JsonlRecorder:
    """Appends each record as one JSON line to `path`, from a writer thread (bounded queue)."""

    def __init__(self, path: Path, max_pending: int) -> None:
        self.path = path
        self.dropped = 0
        self.written = 0
        self._queue: queue.Queue[CallRecord | None] = queue.Queue(max_pending)
        self._thread = threading.Thread(target=self._write, name="gateway-recorder", daemon=True)
        self._thread.start()

    def record(self, call: CallRecord) -> None:
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            self.dropped += 1

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            while (call := self._queue.get()) is not _STOP:
                lines = [call]
                while not self._queue.empty():  # whatever else is waiting, in one write
                    item = self._queue.get_nowait()
                    if item is _STOP:
                        self._queue.put(_STOP)
                        break
                    lines.append(item)
                handle.write("".join(json.dumps(asdict(c), separators=(",", ":")) + "\n" for c in lines))
                handle.flush()
                self.written += len(lines)

    async def close(self) -> None:
        await asyncio.to_thread(self._queue.put, _STOP)
        await asyncio.to_thread(self._thread.join, 10.0)
