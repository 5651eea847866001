"""A run's state from its run directory alone (services/scheduler/ledger/run_record.py) and `grpo-mesh
status --run-dir` on a run whose scheduler is gone: finished, failed, stopped, killed. The runs are
real orchestrator runs against in-memory peers (tests/scheduler/fakes.py), so the record is the one a
scheduler writes."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
import tomli_w

from services.scheduler.ledger.run_record import has_record, read_record
from services.scheduler.ledger.store import FILE_NAME
from services.scheduler.pipeline.weight_sync import AlignmentError
from tests.scheduler.fakes import FakeRollout, cluster
from tests.scheduler.test_status_view import _cli


def _config(run_dir: Path, max_steps: int) -> None:
    scheduler = {"max_steps": max_steps, "weight_transport": "shared_memory", "group_size": 2}
    (run_dir / "run.toml").write_text(tomli_w.dumps({"scheduler": scheduler}))


async def test_a_finished_run_reads_as_the_live_scheduler_said_it_and_the_cli_shows_it(
    tmp_path: Path,
) -> None:
    c = cluster(tmp_path, FakeRollout("r0"), max_steps=3)
    await c.run()
    live = c.orchestrator.status()
    _config(tmp_path, 3)
    record = read_record(tmp_path)
    s = record.status
    assert record.ending == "finished" and s.finished and not s.error
    assert (s.step, s.learner_version, s.max_steps) == (live.step, live.learner_version, 3) == (3, 3, 3)
    assert dict(s.groups_by_state) == live.groups_by_state
    assert s.reward_mean == pytest.approx(live.reward_mean) and s.weight_transport == "shared_memory"
    assert s.last_sync.total_ms > 0 and s.steps_per_second > 0

    (tmp_path / "scheduler.port").write_text("1\n")  # what a gone scheduler leaves: nothing listens
    code, out, err = await _cli("--run-dir", str(tmp_path), "--timeout", "2")
    assert code == 0, err
    for needle in ("the scheduler is not running", "from the run's record", "finished", "3/3 (100%)",
                   "groups trained", "via shared_memory"):  # fmt: skip
        assert needle in out, (needle, out)
    (tmp_path / "scheduler.port").unlink()  # no port file at all: the record still answers
    code, out, _ = await _cli("--run-dir", str(tmp_path))
    assert code == 0 and "no scheduler port file" in out and "3/3 (100%)" in out
    # --address asks that scheduler and nothing else
    code, _, err = await _cli("--run-dir", str(tmp_path), "--address", "127.0.0.1:1", "--timeout", "2")
    assert code == 2 and "is unreachable" in err


async def test_a_failed_run_shows_its_error_and_exits_1(tmp_path: Path) -> None:
    async def drift(rollout: FakeRollout) -> float:
        return 0.01 if rollout.version >= 2 else 0.0

    c = cluster(tmp_path, FakeRollout("r0", on_probe=drift), max_steps=6)
    with pytest.raises(AlignmentError):
        await c.run()
    _config(tmp_path, 6)
    record = read_record(tmp_path)
    assert record.ending == "failed" and "misalignment" in record.status.error
    code, out, _ = await _cli("--run-dir", str(tmp_path))
    assert code == 1 and "failed" in out and "misalignment" in out


async def test_a_stopped_run_and_a_killed_one_say_which(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeRollout("r0"), max_steps=1000)
    task = asyncio.create_task(c.orchestrator.run())
    while c.orchestrator.step < 2:  # noqa: ASYNC110 (the orchestrator has no per-step event)
        await asyncio.sleep(0.01)
    task.cancel()  # what SIGTERM does to the scheduler's run
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    _config(tmp_path, 1000)
    record = read_record(tmp_path)
    assert record.ending == "stopped" and not record.status.finished
    # the ledger's trained steps count too: the step the scheduler reached is the record's (its trainer
    # is cancelled with the run, so no step is trained after the ending is written)
    assert record.status.step == c.orchestrator.step >= 2
    code, out, _ = await _cli("--run-dir", str(tmp_path))
    assert code == 0 and "stopped" in out

    # a kill -9 leaves no ending: the record says the run is not running and ended without a word
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        db.execute("DELETE FROM events WHERE kind = 'run_stopped'")
    assert read_record(tmp_path).ending == ""
    code, out, _ = await _cli("--run-dir", str(tmp_path))
    assert code == 0 and "no ending recorded" in out


def test_a_directory_without_a_record_is_not_a_run(tmp_path: Path) -> None:
    assert not has_record(tmp_path)
    with pytest.raises(FileNotFoundError, match="holds no run record"):
        read_record(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5, "weight_version": 1}\n{"ste')
    record = read_record(tmp_path)  # a half-written last line is left out; no ledger, no config
    assert (record.status.step, record.status.reward_mean, record.ending) == (1, 0.5, "")
