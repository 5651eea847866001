"""A ledger that lost its last transactions (a power loss) while the learner's later checkpoint survived,
against in-memory peers (the same with real processes: tests/e2e/test_power_loss.py). The ledger
wins: the learner goes back to a checkpoint the ledger accounts for and the run goes on from there."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from services.scheduler.ledger.audit import audit
from services.scheduler.ledger.recovery import LedgerMismatch
from services.scheduler.ledger.store import FILE_NAME, read_ledger
from tests.scheduler.fakes import FakeLearner, FakeRollout, cluster


def _copy(source: Path, target: Path) -> None:
    """A consistent copy of a ledger database (SQLite's backup API)."""
    src, dst = sqlite3.connect(source), sqlite3.connect(target)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


async def _ahead_of_its_ledger(tmp_path: Path) -> tuple[Path, FakeLearner, FakeRollout, object]:
    """A run to step 6 whose ledger is put back to how it was at step 3."""
    run_dir, saved = tmp_path / "run", tmp_path / "saved"
    saved.mkdir()
    learner, rollout = FakeLearner(), FakeRollout("r0")
    learner.checkpoints = {2, 5, 6}
    first = cluster(run_dir, rollout, learner=learner, max_steps=3)
    await first.run()
    _copy(run_dir / FILE_NAME, saved / FILE_NAME)
    second = cluster(run_dir, rollout, env=first.env, learner=learner, max_steps=6)
    await second.run()
    assert learner.version == 6 and rollout.version == 6
    for suffix in ("", "-wal", "-shm"):  # what the disk kept: the ledger as it was at step 3
        (run_dir / f"{FILE_NAME}{suffix}").unlink(missing_ok=True)
    _copy(saved / FILE_NAME, run_dir / FILE_NAME)
    return run_dir, learner, rollout, first.env


async def test_a_learner_ahead_of_a_ledger_that_lost_its_last_writes_goes_back_and_the_run_finishes(
    tmp_path: Path,
) -> None:
    run_dir, learner, rollout, env = await _ahead_of_its_ledger(tmp_path)
    assert max(read_ledger(run_dir).batches) == 2  # the ledger knows steps 0..2: 3 steps

    third = cluster(run_dir, rollout, env=env, learner=learner, max_steps=8)
    await third.run()
    assert third.orchestrator.finished and not third.orchestrator.error
    assert learner.restores == [(6, 2)]  # its newest checkpoint at or before step 3, the ledger's
    steps = [b.step for b in learner.batches]
    assert steps == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 7]  # batch 2 again, then the run goes on
    assert rollout.version == 8
    snapshot = read_ledger(run_dir)
    report = audit(snapshot)
    assert report.ok, report.violations
    assert report.summary["steps"] == 8
    restores = [detail for kind, _, detail in snapshot.events if kind == "learner_restore"]
    assert restores == [{"from_step": 6, "to_step": 2, "ledger_steps": 3, "instance": "l1"}]
    rewinds = [detail for kind, _, detail in snapshot.events if kind == "learner_rewind"]
    assert rewinds[0]["from_version"] == 6 and rewinds[0]["to_version"] == 2  # the rollout held v6


async def test_a_ledger_of_another_run_is_refused_before_the_learner_goes_back(tmp_path: Path) -> None:
    run_dir, learner, rollout, env = await _ahead_of_its_ledger(tmp_path)
    db = sqlite3.connect(run_dir / FILE_NAME)
    with db:
        db.execute("UPDATE meta SET value = 'another-run' WHERE key = 'lineage_id'")
    db.close()
    third = cluster(run_dir, rollout, env=env, learner=learner, max_steps=8)
    with pytest.raises(LedgerMismatch, match="another-run"):
        await third.run()
    assert not learner.restores and learner.version == 6  # nothing went back
