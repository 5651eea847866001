"""The ledger store's durable points hold when the task that flushes is cancelled mid-write."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from services.scheduler.ledger.store import LedgerStore, read_ledger


async def test_a_flush_cancelled_while_its_write_is_queued_still_writes_before_close(tmp_path: Path) -> None:
    store = LedgerStore(tmp_path)
    await store.open()
    busy, release = threading.Event(), threading.Event()

    def occupy() -> None:  # the store's only thread is busy, so the flush's write waits in its queue
        busy.set()
        release.wait(10)

    blocker = asyncio.get_running_loop().run_in_executor(store._executor, occupy)
    await asyncio.to_thread(busy.wait, 10)
    store.trained(0, "b0", 1, "learner-a", 0)
    flusher = asyncio.create_task(store.flush())
    await asyncio.sleep(0.01)
    assert not store.dirty  # the row left the queue: only the queued write holds it now
    flusher.cancel()  # what the run's end does to the background flusher
    await asyncio.gather(flusher, return_exceptions=True)
    release.set()
    await blocker
    await store.close()
    [row] = read_ledger(tmp_path).trainings
    assert (row.step, row.batch_id, row.version_after) == (0, "b0", 1)
