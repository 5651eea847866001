"""Batch assembly: the next optimizer step's B groups.

    batches to train again (a restart's replay, from the ledger)  ─┐
    scored groups a restart found unbatched (requeued)             ├─▶ next() ─▶ (row, groups, staleness)
    scored groups from the pipeline (GroupPipeline.scored)         ─┘

A batch trained again keeps its id and its groups, read back from the ledger. A new batch takes the
groups in the order they were scored; one that is now too stale (a slow rollout finished late) or
that has a token of a version a learner rewind took back is dropped, and its prompt issued again. A
new batch is on disk before the learner sees it, so its id always names the same groups.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from services.scheduler.config import SchedulerSettings
from services.scheduler.ledger.lineage import Lineage
from services.scheduler.ledger.recovery import LOST_LINEAGE
from services.scheduler.ledger.store import BatchRow, LedgerStore
from services.scheduler.peers.clients import ScoredGroup
from services.scheduler.peers.rollouts import RolloutPool
from services.scheduler.pipeline.groups import GroupPipeline


@dataclass(frozen=True)
class PlannedBatch:
    row: BatchRow
    groups: list[ScoredGroup]
    staleness: list[int]  # per group: the version it trains at minus its oldest token's version
    retrained: bool  # a batch of the ledger trained again (after a restart)


class BatchAssembler:
    """Replayed batches first, then requeued groups, then the pipeline's scored groups."""

    def __init__(
        self,
        settings: SchedulerSettings,
        groups: GroupPipeline,
        lineage: Lineage,
        store: LedgerStore,
        pool: RolloutPool,
    ) -> None:
        self._settings = settings
        self._groups, self._lineage, self._store, self._pool = groups, lineage, store, pool
        self._recovered: deque[ScoredGroup] = deque()  # scored groups a restart found unbatched
        self._replay: deque[BatchRow] = deque()  # batches to train (again) before new ones
        self._staleness_total, self._staleness_groups = 0, 0  # over every trained group

    def replay(self, rows: Iterable[BatchRow]) -> None:
        """Train these batches (again) before any new one, in this order (replaces an earlier replay)."""
        self._replay = deque(rows)

    def retry(self, row: BatchRow) -> None:
        """`row` was not acknowledged (the learner went away): it goes first, under the same id."""
        self._replay.appendleft(row)

    def requeue(self, groups: Iterable[ScoredGroup]) -> None:
        """Scored groups to batch before the pipeline's (a restart found them unbatched)."""
        self._recovered.extend(groups)

    @property
    def waiting(self) -> int:
        """Requeued groups not yet in a batch."""
        return len(self._recovered)

    def trained(self, staleness: list[int]) -> None:
        """A batch with these staleness values was trained (for `staleness_mean`)."""
        self._staleness_total += sum(staleness)
        self._staleness_groups += len(staleness)

    @property
    def staleness_mean(self) -> float:
        """Mean staleness over every group trained by this scheduler."""
        return self._staleness_total / max(1, self._staleness_groups)

    async def next(self, step: int, version: int) -> PlannedBatch:
        """The batch of `step` (the learner at `version`): one to train again if any, else a new one."""
        if self._replay:
            row = self._replay.popleft()
            stored = await self._store.load_scored(row.group_ids)
            missing = [gid for gid in row.group_ids if gid not in stored]
            if missing:
                raise RuntimeError(f"batch {row.batch_id}: the ledger lacks scored groups {missing}")
            groups = [stored[gid] for gid in row.group_ids]
            return PlannedBatch(row, groups, [row.train_version - min(g.versions) for g in groups], True)
        groups, staleness = await self._collect(version)
        row = BatchRow(step, f"step-{step}", version, tuple(g.group_id for g in groups))
        self._lineage.record(row)
        await self._store.commit_batch(row)
        return PlannedBatch(row, groups, staleness, False)

    async def _collect(self, version: int) -> tuple[list[ScoredGroup], list[int]]:
        """B groups within the staleness bound; late ones (and ones of a lost learner lineage) are
        dropped and their prompts issued again."""
        groups, staleness = [], []
        while len(groups) < self._settings.groups_per_batch:
            group = self._recovered.popleft() if self._recovered else await self._groups.scored.get()
            if self._lineage.lost(group):
                self._groups.drop(group.group_id, LOST_LINEAGE, group.prompt)
                await self._pool.notify()
                continue
            age = version - min(group.versions)
            if age > self._settings.max_staleness:
                self._groups.drop(group.group_id, f"stale by {age} versions", group.prompt)
                await self._pool.notify()
                continue
            groups.append(group)
            staleness.append(age)
        return groups, staleness
