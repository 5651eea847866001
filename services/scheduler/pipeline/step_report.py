"""What each step leaves behind: its metrics row (`metrics.jsonl`, the trackers, the histograms), the
evaluations on the held-out split, and the figures GetStatus reports from the last row.

A row has the batch's rewards and staleness, the learner's metrics, the step's sync phases, the
alignment probe, the rates of the pipeline since the last row, an env's difficulty levels
(`curriculum/level_<name>/success`, `.../drawn`: `curriculum.py`) and, every `eval_every` steps, the
evaluation (`evaluation.py`; a peer restarting skips one evaluation, not the run).
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.ledger.group_ledger import GroupLedger
from services.scheduler.observe.metrics import MetricsLog, observe_step, step_record
from services.scheduler.observe.timeline import EVALUATE, Timeline
from services.scheduler.observe.tracking import Tracker
from services.scheduler.peers.clients import StepResult
from services.scheduler.pipeline.alignment import Alignment
from services.scheduler.pipeline.batches import PlannedBatch
from services.scheduler.pipeline.evaluation import Evaluator
from services.scheduler.pipeline.groups import GroupPipeline
from services.scheduler.pipeline.weight_sync import SyncResult

log = get_logger(__name__)


class StepReport:
    """Writes each step's row (and the rows of events) to the run's metrics log, opened by `open`."""

    def __init__(
        self,
        settings: SchedulerSettings,
        groups: GroupPipeline,
        ledger: GroupLedger,
        evaluator: Evaluator,
        timeline: Timeline,
    ) -> None:
        self._settings = settings
        self._groups, self._ledger, self._evaluator, self._timeline = groups, ledger, evaluator, timeline
        self._log: MetricsLog | None = None

    @property
    def metrics(self) -> MetricsLog:
        assert self._log is not None, "open() the report first"
        return self._log

    def open(self) -> MetricsLog:
        """Open `<run_dir>/metrics.jsonl` (appended to: a restarted scheduler continues it)."""
        self._log = MetricsLog(self._settings.run_dir)
        return self._log

    async def track(self, run_id: str) -> None:
        """From now on, rows also go to TensorBoard / W&B (opened off the loop: W&B may wait on the
        network)."""
        cfg = self._settings
        config = cfg.model_dump(mode="json", exclude={"security"})
        tracker = await asyncio.to_thread(
            Tracker, cfg.run_dir, cfg.tracking, run_name=f"grpo-{run_id}", config=config
        )
        self.metrics.attach(tracker)

    async def evaluate_only(self, step: int, version: int) -> None:
        """A row with only the evaluation of `version` (before the first step)."""
        record = {"step": step, "weight_version": version, "eval_only": True}
        self.metrics.write(record | await self._evaluator.run(version))

    async def step(
        self,
        planned: PlannedBatch,
        result: StepResult,
        sync: SyncResult,
        rollouts_synced: int,
        train_ms: float,
        alignment: Alignment,
        evaluate: bool,
    ) -> dict[str, Any]:
        """Write the row of a trained step (evaluating first when `evaluate` and it is an eval step)."""
        filtered = self._groups.take_filtered()
        record = step_record(
            planned.groups, planned.staleness, result, **sync.record(),
            weight_transport=self._settings.weight_transport.value,
            logprob_abs_diff_max=alignment.sampled,
            tokens_per_s=self._groups.tokens.take(),
            groups_dropped=self._ledger.counts()["dropped"],
            train_ms=train_ms,
            rollouts_synced=rollouts_synced,  # healthy rollouts on this version after the step's sync
            retrained=planned.retrained,
            filtered_groups=filtered,
            filtered_fraction=filtered / (filtered + len(planned.groups)),
        )  # fmt: skip
        if self._groups.levels is not None:  # an env with levels: their rates and the prompts drawn
            record.update(self._groups.levels.record())
        if self._groups.episodes.multi_turn:  # run-wide: dropped groups' violations count too
            record["episode/prefix_violations"] = self._groups.episodes.counts.prefix_violations
            record["episode/failures_total"] = self._groups.episodes.counts.failures
            record["logprob_abs_diff_max_env"] = alignment.env
        every = self._settings.eval_every
        if evaluate and every and result.step % every == 0:
            try:
                with self._timeline.timed(EVALUATE, "evaluate", version=result.weight_version):
                    record.update(await self._evaluator.run(result.weight_version))
            except GrpoError as exc:  # a peer restarting: skip this evaluation, not the run
                log.warning("evaluation skipped", error=str(exc))
                record["eval_error"] = str(exc)
        self.metrics.write(record)
        observe_step(record, planned.staleness)
        log.info(
            "step", step=result.step, reward=round(record["reward_mean"], 4), loss=round(record["loss"], 5),
            sync_ms=round(sync.total_ms, 1), diff=alignment.sampled,
        )  # fmt: skip
        return record

    def status_fields(self) -> dict[str, Any]:
        """GetStatus's figures from the last row (none before the run starts)."""
        return {} if self._log is None else self._log.status_fields()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
