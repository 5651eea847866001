"""The audit's invariant checks on hand-made good and bad ledgers, and its command line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from services.scheduler.ledger.audit import audit
from services.scheduler.ledger.group_ledger import GroupState
from services.scheduler.ledger.store import BatchRow, LedgerStore, TrainingRow

from .test_recovery import _row, _snapshot, _trained

T, S, D = GroupState.TRAINED, GroupState.SCORED, GroupState.DROPPED


def _good():
    return _snapshot(
        [
            ("a", 0, T, [0]),
            ("b", 1, D, [], True),
            ("b", 1, T, [0]),
            ("c", 2, T, [0]),
            ("d", 3, T, [1]),
            ("e", 4, S, [2]),
        ],
        batches=[_row(0, "a#0", "b#1"), _row(1, "c#0", "d#0")],
        trainings=[_trained(0), _trained(1)],
    )


def test_a_clean_ledger_passes_with_its_counts() -> None:
    report = audit(_good())
    assert report.ok, report.violations
    assert report.summary["steps"] == 2 and report.summary["groups_regenerated"] == 1
    assert report.summary["positions"] == 5


def test_a_rewound_and_retrained_step_counts_once_in_the_surviving_lineage() -> None:
    snapshot = _good()
    snapshot.trainings.append(TrainingRow(3, 1, "step-1", 2, "other", 1))
    report = audit(snapshot)
    assert report.ok and report.summary["steps_retrained"] == 1


def test_each_broken_invariant_is_reported() -> None:
    twice = _good()  # a group in two batches, and a batch of the wrong size
    twice.batches[2] = BatchRow(2, "step-2", 2, ("d#0",))
    twice.trainings.append(_trained(2))
    skipped = _good()  # position 5 has a group, 4 is gone: a prompt skipped
    next(g for g in skipped.groups if g.position == 4).position = 5
    stale = _good()  # step 1 trained at version 1 a group made by version -1: 2 versions stale
    stale.groups[3].versions = (-1,)
    wrong = _good()  # step 1 trained a different batch than the ledger's
    wrong.trainings[1] = TrainingRow(2, 1, "step-9", 2, "i", 0)
    gap = _good()
    gap.trainings = [gap.trainings[1]]
    expected = {
        "is in the batches of steps 1 and 2": twice,
        "has 1 groups, expected 2": twice,
        "never issued (skipped): [4]": skipped,
        "2 versions stale": stale,
        "trained batch 'step-9'": wrong,
        "not contiguous from 0": gap,
    }
    for needle, snapshot in expected.items():
        violations = audit(snapshot).violations
        assert any(needle in v for v in violations), (needle, violations)


async def _ledger(run_dir: Path, trainings: list[tuple[int, str]]) -> None:
    store = LedgerStore(run_dir)
    await store.open()
    store.set_meta(max_staleness=1, groups_per_batch=0)
    await store.commit_batch(BatchRow(0, "step-0", 0, ()))
    for step, batch_id in trainings:
        store.trained(step, batch_id, step + 1, "i", 0)
    await store.close()


def test_the_command_line_exits_nonzero_on_a_violation(tmp_path: Path) -> None:
    good, bad = tmp_path / "good", tmp_path / "bad"
    asyncio.run(_ledger(good, [(0, "step-0")]))
    asyncio.run(_ledger(bad, [(0, "step-0"), (0, "step-7")]))
    command = [sys.executable, "-m", "services", "audit"]  # = grpo-mesh audit
    ok = subprocess.run([*command, str(good)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "audit: OK" in ok.stdout, ok.stdout + ok.stderr
    broken = subprocess.run([*command, str(bad)], capture_output=True, text=True, timeout=60)
    assert broken.returncode == 1 and "trained batch 'step-7'" in broken.stdout
    missing = subprocess.run([*command, str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "no ledger" in missing.stderr
