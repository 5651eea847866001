"""`grpo-mesh audit RUN_DIR`: check a run's ledger for exactly-once training.

Invariants, from the ledger alone (`store.py`), across any number of restarts:

1. each optimizer step 0..N-1 of the surviving learner lineage trained exactly one batch: the step's
   latest training (a learner restart re-trains steps; the newest row is the surviving one) is the
   ledger's batch for that step, and it moved the weights to version step + 1;
2. no group is in two batches, every batch has B groups, and a group is trained iff its batch was;
3. every position of the env's train stream up to the last one taken has a group (nothing skipped)
   and at most one trained group (no prompt trained twice). A run whose curriculum drew by level
   (meta `level_count` = K, pipeline/curriculum.py) takes each level's positions, p % K, in order
   but at its own pace: every position up to the last one taken *of its level* has a group;
4. every trained group's staleness, the version its batch trained at minus the oldest version that
   produced one of its tokens, is within `max_staleness`, and no token is newer than that version.

Prints a summary and the violations; exits 1 if there is any (2: no ledger, or a bad command line).
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field
from pydantic_settings import CliPositionalArg

from services.common.config import CommandSettings, parse_cli
from services.scheduler.ledger.group_ledger import GroupState
from services.scheduler.ledger.store import Snapshot, TrainingRow, read_ledger

PROG = "grpo-mesh audit"


class AuditSettings(CommandSettings):
    """Check a run's ledger for exactly-once training: each step trained one batch, no group or prompt
    trained twice or skipped, every trained group within max_staleness.

    Exit 0 OK, 1 listing every violation, 2 when there is no ledger.
    """

    run_dir: CliPositionalArg[Path] = Field(description="The run directory (holds ledger.sqlite).")


@dataclass
class AuditReport:
    summary: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def _surviving(trainings: list[TrainingRow]) -> dict[int, TrainingRow]:
    """Each step's newest training (rows are in write order)."""
    latest: dict[int, TrainingRow] = {}
    for row in trainings:
        latest[row.step] = row
    return latest


def audit(snapshot: Snapshot) -> AuditReport:
    report = AuditReport()
    bad = report.violations.append
    max_staleness = int(snapshot.meta.get("max_staleness", "0"))
    batch_size = int(snapshot.meta.get("groups_per_batch", "0"))
    groups = {g.group_id: g for g in snapshot.groups}

    # 1. steps: one batch each, contiguous, versions advancing by one
    trained = _surviving(snapshot.trainings)
    steps = sorted(trained)
    if steps != list(range(len(steps))):
        missing = sorted(set(range(max(steps, default=-1) + 1)) - set(steps))
        bad(f"optimizer steps are not contiguous from 0: steps {missing[:10]} were never trained")
    for step, row in trained.items():
        batch = snapshot.batches.get(step)
        if batch is None:
            bad(f"step {step} was trained but the ledger has no batch for it")
        elif row.batch_id != batch.batch_id:
            bad(
                f"step {step} trained batch {row.batch_id!r}; the ledger's batch for it is {batch.batch_id!r}"
            )
        if row.version_after != step + 1:
            bad(f"step {step} moved the weights to version {row.version_after}, expected {step + 1}")

    # 2. batches: disjoint, full, and consistent with the groups' states
    owner: dict[str, int] = {}
    for step, batch in sorted(snapshot.batches.items()):
        if batch_size and len(batch.group_ids) != batch_size:
            bad(f"batch {batch.batch_id} has {len(batch.group_ids)} groups, expected {batch_size}")
        if batch.train_version != step:
            bad(f"batch {batch.batch_id} trains at version {batch.train_version}, expected {step}")
        for gid in batch.group_ids:
            if gid in owner:
                bad(f"group {gid} is in the batches of steps {owner[gid]} and {step}")
            owner[gid] = step
            if gid not in groups:
                bad(f"batch {batch.batch_id} holds unknown group {gid}")
    for gid, record in groups.items():
        in_trained_batch = owner.get(gid) in trained
        if (record.state == GroupState.TRAINED) != in_trained_batch:
            where = "a trained batch" if in_trained_batch else "no trained batch"
            bad(f"group {gid} is {record.state} but in {where}")

    # 3. the prompt stream: no position skipped, none trained twice
    by_position: dict[int, list] = defaultdict(list)
    for record in snapshot.groups:
        by_position[record.position].append(record)
    last = max(by_position, default=-1)
    k = int(snapshot.meta.get("level_count", "1"))  # > 1: drawn by level (each level its residue)
    top = dict.fromkeys(range(k), -1)
    for position in by_position:
        top[position % k] = max(top[position % k], position // k)
    skipped = [p for p in range(last + 1) if p not in by_position and p // k <= top[p % k]]
    if skipped:
        bad(f"train positions never issued (skipped): {skipped[:10]}{' ...' if len(skipped) > 10 else ''}")
    for position, records in by_position.items():
        done = [r.group_id for r in records if r.state == GroupState.TRAINED]
        if len(done) > 1:
            bad(f"position {position} was trained {len(done)} times: {done}")

    # 4. staleness of every trained group, measured on the ledger's own version records
    for step in steps:
        batch = snapshot.batches.get(step)
        for gid in batch.group_ids if batch else ():
            record = groups.get(gid)
            if record is None:
                continue
            if not record.versions:
                bad(f"group {gid} (step {step}) has no weight versions recorded")
                continue
            age = batch.train_version - min(record.versions)
            if age > max_staleness:
                bad(f"group {gid} trained at version {batch.train_version} is {age} versions stale "
                    f"(max_staleness {max_staleness})")  # fmt: skip
            if max(record.versions) > batch.train_version:
                bad(f"group {gid} has tokens of version {max(record.versions)}, newer than its batch's "
                    f"version {batch.train_version}")  # fmt: skip

    states = Counter(r.state.value for r in snapshot.groups)
    events = Counter(kind for kind, _, _ in snapshot.events)
    report.summary = {
        "steps": len(steps),
        "batches": len(snapshot.batches),
        "trainings": len(snapshot.trainings),
        "steps_retrained": len(snapshot.trainings) - len(trained),
        "positions": last + 1,
        "groups": len(snapshot.groups),
        **{f"groups_{state.value}": states.get(state.value, 0) for state in GroupState},
        "groups_regenerated": sum(1 for r in snapshot.groups if r.attempt > 0),
        "scheduler_starts": events.get("scheduler_start", 0),
        "learner_restarts": events.get("learner_restart", 0),
    }
    return report


def parse(argv: list[str], prog: str = PROG) -> AuditSettings:
    """The command line; SystemExit(2) on a bad one."""
    return parse_cli(AuditSettings, argv, prog)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        snapshot = read_ledger(args.run_dir)
    except FileNotFoundError as exc:
        print(f"audit: {exc}", file=sys.stderr)
        return 2
    report = audit(snapshot)
    run = snapshot.meta.get("run_id", "?")
    print(f"ledger {args.run_dir / 'ledger.sqlite'} (run {run})")
    for key, value in report.summary.items():
        print(f"  {key:<20} {value}")
    if report.ok:
        print("audit: OK (one batch per step; no group or prompt twice or skipped; staleness bounded)")
        return 0
    print(f"audit: {len(report.violations)} violation(s)")
    for violation in report.violations:
        print(f"  - {violation}")
    return 1
