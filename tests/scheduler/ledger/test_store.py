"""The ledger store's durable points hold when the task that flushes is cancelled mid-write; the learner
logprobs it keeps per group."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path

import pytest

from grpo.common.v1 import types_pb2
from services.scheduler.ledger.store import FILE_NAME, LedgerStore, read_ledger
from services.scheduler.ledger.token_scores import read_learner_logprobs
from services.scheduler.peers.clients import ScoredGroup


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


async def test_learner_logprobs_are_stored_per_group_replaced_by_a_retraining_and_read_read_only(
    tmp_path: Path,
) -> None:
    def group(gid: str, lengths: list[int]) -> ScoredGroup:
        completions = [types_pb2.Completion(completion_token_ids=[1] * n) for n in lengths]
        return ScoredGroup(gid, types_pb2.Prompt(), completions, [0.0] * len(lengths), [], set())

    path = tmp_path / FILE_NAME
    store = LedgerStore(tmp_path)
    await store.open()
    assert read_learner_logprobs(path, ["a"]) == {}
    a, b = group("a", [2, 1]), group("b", [3])
    store.learner_logprobs(0, [a, b], [[-0.5, -1.5], [-2.0], [-0.25, -0.75, -3.0]])
    store.learner_logprobs(0, [a, b], [[-1.0]])  # does not match the batch: logged, not stored
    store.learner_logprobs(0, [a, b], [])  # an answer without any: nothing
    await store.flush()
    assert read_learner_logprobs(path, ["b", "a", "c"]) == {
        "a": [[-0.5, -1.5], [-2.0]], "b": [[-0.25, -0.75, -3.0]],
    }  # fmt: skip
    store.learner_logprobs(4, [b], [[-1.0, -1.0, -1.0]])  # trained again (a replay): replaced
    await store.close()
    assert read_learner_logprobs(path, ["a", "b"]) == {"a": [[-0.5, -1.5], [-2.0]], "b": [[-1.0] * 3]}
    db = sqlite3.connect(path)
    assert dict(db.execute("SELECT group_id, step FROM learner_logprobs")) == {"a": 0, "b": 4}
    db.execute("DROP TABLE learner_logprobs")  # a ledger written before the table existed
    db.commit()
    db.close()
    assert read_learner_logprobs(path, ["a"]) == {}
    with pytest.raises(sqlite3.OperationalError):  # read-only: a reader never creates a ledger
        read_learner_logprobs(tmp_path / "missing.sqlite", ["a"])
