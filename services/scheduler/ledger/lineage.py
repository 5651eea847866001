"""The learner's lineage as the run's record knows it: which learner process trains the run, which
batch each step trained, and what a learner that came back from an older checkpoint takes back.

Every learner process has an instance id; every run a lineage id, which its checkpoints carry. A
learner that answers with another instance was restarted: the ledger says what it lacks
(`recovery.plan_recovery`). One that answers with another lineage belongs to another run
(`LedgerMismatch`); one ahead of the ledger is first told to go back (`recovery.py`). A learner
whose weights are older than what the run had reached starts a new lineage generation (a rewind):
the batches since its checkpoint are trained again, every rollout holding newer weights goes back to
the learner's first, and a scored group with a token of a version the rewind took back can no longer
be trained (`lost`).
"""

from __future__ import annotations

import statistics

from services.common.logging import get_logger
from services.scheduler.ledger.group_ledger import GroupLedger, GroupState
from services.scheduler.ledger.recovery import LedgerMismatch, RecoveryPlan, plan_recovery
from services.scheduler.ledger.store import BatchRow, LedgerStore, Snapshot
from services.scheduler.observe.metrics import MetricsLog
from services.scheduler.peers.clients import LearnerInfo, ScoredGroup
from services.scheduler.peers.rollouts import RolloutPool

log = get_logger(__name__)


class Lineage:
    """The learner instance and lineage the run trains with, its batches by step, and its rewinds."""

    def __init__(self, ledger: GroupLedger, store: LedgerStore, pool: RolloutPool) -> None:
        self._ledger, self._store, self._pool = ledger, store, pool
        self.generation = 0  # +1 at every rewind
        self._rewinds: list[tuple[int, int]] = []  # (generation started, version rewound to)
        self._instance = ""
        self._lineage = ""
        self._batches: dict[int, BatchRow] = {}  # every batch of the run, by step (ids only)

    def start(self, state: LearnerInfo) -> None:
        """The learner this scheduler found at start."""
        self._instance, self._lineage = state.instance_id, state.lineage_id

    def check(self, snapshot: Snapshot, state: LearnerInfo) -> None:
        """Refuse a ledger of another lineage than the learner's (before anything is changed)."""
        ledger_lineage = snapshot.meta.get("lineage_id", "")
        if ledger_lineage and state.lineage_id and ledger_lineage != state.lineage_id:
            raise LedgerMismatch(
                f"{self._store.path} belongs to learner lineage {ledger_lineage}, but the learner reports "
                f"{state.lineage_id}: point the learner at this run's checkpoints, or use a new run dir"
            )

    def resume(self, snapshot: Snapshot, state: LearnerInfo, discarded_version: int = 0) -> RecoveryPlan:
        """Take over an earlier incarnation's ledger: restore its groups, drop the ones in flight (their
        prompts are issued again) and return the plan (`recovery.py`) for the learner at `state`
        (`discarded_version`: the version it went back from, when it was ahead of the ledger)."""
        self.check(snapshot, state)
        plan = plan_recovery(snapshot, state, discarded_version)
        self.generation = int(snapshot.meta.get("generation", "0"))
        self._batches = dict(snapshot.batches)
        self._ledger.restore(snapshot.groups)
        for group_id, reason in plan.drop:
            self._ledger.advance(group_id, GroupState.DROPPED, reason, reissue=True)
        return plan

    async def returned(self, state: LearnerInfo) -> RecoveryPlan | None:
        """The learner answers again after it went away: None if it is the same process (nothing was
        lost), else the plan for the restarted one (from the ledger, flushed first)."""
        if state.instance_id == self._instance:
            return None
        if self._lineage and state.lineage_id != self._lineage:
            raise LedgerMismatch(
                f"the learner came back with lineage {state.lineage_id}, not this run's {self._lineage} "
                "(was it restarted without its checkpoint directory?)"
            )
        await self._store.flush()
        self._instance = state.instance_id
        return plan_recovery(await self._store.snapshot(), state)

    async def apply(self, plan: RecoveryPlan, state: LearnerInfo, metrics: MetricsLog) -> list[BatchRow]:
        """Acknowledge the batches the learner trained unacknowledged, write the rows an earlier
        incarnation never wrote, and on a rewind start a new generation whose rollouts must first go
        back to the learner. Returns the batches to train (again), in step order."""
        for row in plan.acknowledge:
            self.acknowledge(row)
        await self._write_missing_rows(state.step, metrics)
        if plan.rewound_from is None:
            return list(plan.replay)
        self.generation += 1
        self._rewinds.append((self.generation, state.weight_version))
        self._store.set_meta(generation=self.generation)
        self._store.event(
            "learner_rewind", to_version=state.weight_version, from_version=plan.rewound_from,
            retrain=[b.step for b in plan.replay], generation=self.generation,
        )  # fmt: skip
        self._pool.require_sync_above(state.weight_version)  # weights of the lost lineage
        metrics.write(
            {"event": "learner_rewind", "step": state.step, "weight_version": state.weight_version,
             "rewound_from_version": plan.rewound_from, "steps_to_retrain": len(plan.replay)}
        )  # fmt: skip
        log.warning(
            "learner restarted from an older checkpoint: training its lost steps again",
            to_version=state.weight_version,
            from_version=plan.rewound_from,
            retrain=[b.step for b in plan.replay],
        )
        return list(plan.replay)

    def lost(self, group: ScoredGroup) -> bool:
        """Issued before a rewind, with tokens of a version that rewind took back."""
        generation = self._ledger.get(group.group_id).generation
        floors = [floor for started, floor in self._rewinds if started > generation]
        return bool(floors) and max(group.versions) > min(floors)

    def record(self, row: BatchRow) -> None:
        """A new batch of the run (committed to the store by the caller)."""
        self._batches[row.step] = row

    def acknowledge(self, row: BatchRow, version_after: int | None = None) -> None:
        """Record that the learner trained `row` (its groups trained; a re-train leaves them so)."""
        for group_id in row.group_ids:
            if self._ledger.get(group_id).state != GroupState.TRAINED:
                self._ledger.advance(group_id, GroupState.TRAINED)
        after = row.step + 1 if version_after is None else version_after  # version = step, always
        self._store.trained(row.step, row.batch_id, after, self._instance, self.generation)

    async def _write_missing_rows(self, learner_step: int, metrics: MetricsLog) -> None:
        """A row for each step the learner trained whose row an earlier incarnation never wrote (it
        died between the step and its row): `"recovered": true`, with what the ledger knows."""
        for step in range(metrics.last_step, learner_step):
            row = self._batches.get(step)
            if row is None:
                continue
            groups = await self._store.load_scored(row.group_ids)
            rewards = [r for g in groups.values() for r in g.rewards]
            metrics.write(
                {"step": step + 1, "weight_version": step + 1, "recovered": True,
                 "reward_mean": statistics.fmean(rewards) if rewards else float("nan")}
            )  # fmt: skip
