"""The central asyncio loop of a run.

Four cooperating tasks, joined by bounded queues:

    prompt feeder ──prompts──▶ dispatcher ──(a task per group)──▶ generate ▶ score ──scored──▶ trainer
    (env.sample)               (admission, least-loaded rollout)    (rollout)  (env)     (learner step, sync)
    health monitor: polls rollouts, brings lagging or (re)joined ones up to the current version.

Each step's sync, probe and metrics row run behind the learner's next step (`step_sync.py`).

Every group is tracked in the ledger, and the ledger is durable (`store.py`: SQLite in the run
directory). A group whose rollout dies is dropped and its prompt re-issued, so a dead worker costs
time, never data; an env or learner that goes away is waited for (a supervisor restarts it); a
learner that comes back from an older checkpoint is caught up by training the same batches again
(`recovery.py`); a restarted scheduler continues from the ledger. The peers are the protocols of
`clients.py`: this module builds no request message and handles no status code (a failure's
`retryable` and `unreachable` say everything the policy needs).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from functools import partial

from services.common.advantages import MODE_FOR_LOSS, AdvantageMode
from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.ledger.group_ledger import GroupLedger, GroupState
from services.scheduler.ledger.recovery import LOST_LINEAGE, LedgerMismatch, RecoveryPlan, plan_recovery
from services.scheduler.ledger.store import BatchRow, LedgerStore, Snapshot, new_run_id
from services.scheduler.observe.metrics import MetricsLog, observe_step, step_record
from services.scheduler.observe.status import RolloutStatus, SchedulerStatus
from services.scheduler.observe.timeline import EVALUATE, LEARNER, Timeline
from services.scheduler.observe.tracking import Tracker
from services.scheduler.peers.clients import (
    EnvClient,
    LearnerClient,
    LearnerInfo,
    ScoredGroup,
    StepResult,
)
from services.scheduler.peers.patience import patiently
from services.scheduler.peers.rollouts import RolloutPool
from services.scheduler.pipeline.alignment import AlignmentProbe
from services.scheduler.pipeline.evaluation import Evaluator
from services.scheduler.pipeline.groups import GroupPipeline
from services.scheduler.pipeline.policy import build_train_batch
from services.scheduler.pipeline.step_sync import StepSync
from services.scheduler.pipeline.weight_sync import SyncResult, WeightSyncer

log = get_logger(__name__)


class Orchestrator:
    def __init__(
        self, settings: SchedulerSettings, env: EnvClient, learner: LearnerClient, pool: RolloutPool
    ) -> None:
        self.settings = settings
        self.env, self.learner, self.pool = env, learner, pool
        self.store = LedgerStore(settings.run_dir)
        self.ledger = GroupLedger(sink=self.store.group_changed)
        self.timeline = Timeline()  # records once the run starts with `trace` on
        self.syncer = WeightSyncer(learner, pool, settings.weight_transport, self.timeline)
        self.alignment = AlignmentProbe(settings, self.syncer)
        self.step_sync = StepSync(self.syncer, self.alignment, pool, self.timeline)
        self.evaluator = Evaluator(settings, env, pool)
        self.groups = GroupPipeline(
            settings, env, pool, self.ledger, self.store, lambda: self.version, lambda: self.generation,
            self.timeline,
        )  # fmt: skip
        self.recovered: deque[ScoredGroup] = deque()  # scored groups a restart found unbatched: first in
        self._batches: dict[int, BatchRow] = {}  # every batch of the run, by step (ids only)
        self._replay: deque[BatchRow] = deque()  # batches to train (again) before new ones
        self.generation = 0  # learner lineage generation: +1 at every rewind
        self._rewinds: list[tuple[int, int]] = []  # (generation started, version rewound to)
        self._learner_instance = ""
        self._lineage = ""
        self.version = 0
        self.step = 0
        self.finished = False
        self.error = ""
        self._staleness_total, self._staleness_groups = 0, 0  # over every trained group (GetStatus)
        self.advantage_mode = settings.advantage_mode
        self._metrics: MetricsLog | None = None  # opened when the run starts
        self._born = time.monotonic()
        self.run_id = ""  # the ledger's, once the run is prepared

    # ---- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Train until max_steps (or cancellation). Records a failure in `self.error` and re-raises."""
        background = []
        self._metrics = MetricsLog(self.settings.run_dir)
        if self.settings.trace:
            self.timeline.open(self.settings.run_dir / "trace.json")
        try:
            snapshot = await self.store.open()
            await self._prepare(snapshot)
            self._metrics.tracker = (
                await asyncio.to_thread(  # opens files; W&B online may wait on the network
                    Tracker,
                    self.settings.run_dir,
                    self.settings.tracking,
                    run_name=f"grpo-{self.run_id}",
                    config=self.settings.model_dump(mode="json", exclude={"security"}),
                )
            )
            background = [
                asyncio.create_task(self.groups.feed(), name="feeder"),
                asyncio.create_task(self.groups.dispatch(), name="dispatcher"),
                asyncio.create_task(self._monitor_health(), name="health"),
                asyncio.create_task(self._flush_ledger(), name="ledger"),
            ]
            trainer = asyncio.create_task(self._train(), name="trainer")
            # Whichever ends first: the trainer (done/failed) or a background task crashing.
            done, _ = await asyncio.wait([trainer, *background], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            if trainer not in done:
                raise RuntimeError("a scheduler task stopped unexpectedly")
            self.finished = True
            log.info("run finished", steps=self.step, version=self.version)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("run failed", error=self.error)
            raise
        finally:
            in_flight = [*self.groups.tasks, *([self.step_sync.job] if self.step_sync.job else [])]
            for task in [*background, *in_flight]:
                task.cancel()
            await asyncio.gather(*background, *in_flight, return_exceptions=True)
            await self.store.close()
            self._metrics.close()
            await asyncio.to_thread(self.timeline.close)

    async def _prepare(self, snapshot: Snapshot) -> None:
        """Learn the learner's version and loss, continue from the ledger if it holds an earlier
        incarnation's run, bring every rollout to the learner's version, fix the probe sequence."""
        # a peer may still be (re)starting: a restarted scheduler must not fail on a learner loading
        state = await patiently(self.settings.recovery, "learner", self.learner.state)
        self.version, self.step = state.weight_version, state.step
        self._learner_instance, self._lineage = state.instance_id, state.lineage_id
        if self.advantage_mode == "auto":
            self.advantage_mode = MODE_FOR_LOSS.get(state.loss, AdvantageMode.group_std)
        resumed = not snapshot.empty
        self.run_id = snapshot.meta.get("run_id") or new_run_id()
        if resumed:
            await self._resume(snapshot, state)
        else:
            cfg = self.settings
            self.store.set_meta(
                run_id=self.run_id,
                lineage_id=state.lineage_id,
                group_size=cfg.group_size,
                groups_per_batch=cfg.groups_per_batch,
                max_staleness=cfg.max_staleness,
                generation=0,
                first_step=state.step,
            )
            self.groups.cursor = 0
        self.store.event("scheduler_start", step=self.step, version=self.version, resumed=resumed)
        await self.store.flush()
        recovery = self.settings.recovery  # a rollout may still be (re)starting
        await self.pool.wait_for_healthy(self.version, recovery.peer_restart_timeout, recovery.retry_interval)
        async with self.syncer.lock:
            lagging = self.pool.behind(self.version)
            if lagging:
                await self.syncer.sync(lagging)
        await self.alignment.make(self.env, self.pool)
        self.step_sync.last_alignment = await self.alignment.check(self.pool.healthy(), self.version)
        log.info(
            "ready to train",
            version=self.version,
            advantage_mode=self.advantage_mode,
            logprob_abs_diff_max=self.step_sync.last_alignment,
        )
        if self.settings.eval_every and not resumed:
            await self._log_eval_only()

    async def _resume(self, snapshot: Snapshot, state: LearnerInfo) -> None:
        """Continue an earlier incarnation's run: see recovery.py for what each part of the plan means."""
        ledger_lineage = snapshot.meta.get("lineage_id", "")
        if ledger_lineage and state.lineage_id and ledger_lineage != state.lineage_id:
            raise LedgerMismatch(
                f"{self.store.path} belongs to learner lineage {ledger_lineage}, but the learner reports "
                f"{state.lineage_id}: point the learner at this run's checkpoints, or use a new run dir"
            )
        plan = plan_recovery(snapshot, state)
        self.generation = int(snapshot.meta.get("generation", "0"))
        self._batches = dict(snapshot.batches)
        self.ledger.restore(snapshot.groups)
        for group_id, reason in plan.drop:
            self.ledger.advance(group_id, GroupState.DROPPED, reason, reissue=True)
        await self._apply_learner_plan(plan, state, rewound_from=plan.rewound_from)
        stored = await self.store.load_scored(plan.requeue)
        self.recovered.extend(stored[gid] for gid in plan.requeue if gid in stored)
        prompts = await self.store.load_prompts(plan.reissue)
        self.groups.reissue.extend((p, prompts[p]) for p in plan.reissue if p in prompts)
        self.groups.cursor = plan.next_position
        log.info(
            "resuming the run from its ledger",
            step=self.step,
            version=self.version,
            replay=[b.step for b in plan.replay],
            acknowledged=[b.step for b in plan.acknowledge],
            requeued=len(self.recovered),
            reissued=len(self.groups.reissue),
            dropped=len(plan.drop),
            cursor=self.groups.cursor,
        )

    async def _apply_learner_plan(
        self, plan: RecoveryPlan, state: LearnerInfo, rewound_from: int | None
    ) -> None:
        """Acknowledge batches the learner trained unacknowledged, queue the ones to train again, and on
        a rewind start a new lineage generation whose rollouts must first go back to the learner."""
        for row in plan.acknowledge:
            self._acknowledge(row, state.instance_id)
        await self._write_missing_rows(state.step)
        self._replay = deque(plan.replay)
        if rewound_from is None:
            return
        self.generation += 1
        self._rewinds.append((self.generation, state.weight_version))
        self.store.set_meta(generation=self.generation)
        self.store.event(
            "learner_rewind", to_version=state.weight_version, from_version=rewound_from,
            retrain=[b.step for b in plan.replay], generation=self.generation,
        )  # fmt: skip
        for handle in self.pool.handles():
            if handle.version > state.weight_version:
                handle.needs_sync = True  # its weights are of the lost lineage: back to the learner's
        assert self._metrics is not None
        self._metrics.write(
            {"event": "learner_rewind", "step": state.step, "weight_version": state.weight_version,
             "rewound_from_version": rewound_from, "steps_to_retrain": len(plan.replay)}
        )  # fmt: skip
        log.warning(
            "learner restarted from an older checkpoint: training its lost steps again",
            to_version=state.weight_version,
            from_version=rewound_from,
            retrain=[b.step for b in plan.replay],
        )

    async def _write_missing_rows(self, learner_step: int) -> None:
        """A row for each step the learner trained whose row an earlier incarnation never wrote (it
        died between the step and its row): `"recovered": true`, with what the ledger knows."""
        assert self._metrics is not None
        for step in range(self._metrics.last_step, learner_step):
            row = self._batches.get(step)
            if row is None:
                continue
            groups = await self.store.load_scored(row.group_ids)
            rewards = [r for g in groups.values() for r in g.rewards]
            self._metrics.write(
                {"step": step + 1, "weight_version": step + 1, "recovered": True,
                 "reward_mean": statistics.fmean(rewards) if rewards else float("nan")}
            )  # fmt: skip

    def _acknowledge(self, row: BatchRow, instance: str, version_after: int | None = None) -> None:
        """Record that the learner trained `row` (its groups trained; a re-train leaves them so)."""
        for group_id in row.group_ids:
            if self.ledger.get(group_id).state != GroupState.TRAINED:
                self.ledger.advance(group_id, GroupState.TRAINED)
        after = row.step + 1 if version_after is None else version_after  # version = step, always
        self.store.trained(row.step, row.batch_id, after, instance, self.generation)

    # ---- training and weight sync ----------------------------------------------------------------

    async def _next_scored(self) -> ScoredGroup:
        return self.recovered.popleft() if self.recovered else await self.groups.scored.get()

    def _lost_lineage(self, group: ScoredGroup) -> bool:
        """Issued before a learner rewind, with tokens of a version that rewind took back."""
        generation = self.ledger.get(group.group_id).generation
        floors = [floor for started, floor in self._rewinds if started > generation]
        return bool(floors) and max(group.versions) > min(floors)

    async def _collect_batch(self) -> tuple[list[ScoredGroup], list[int]]:
        """B groups within the staleness bound; late ones (and ones of a lost learner lineage) are
        dropped and their prompts re-issued."""
        groups, staleness = [], []
        while len(groups) < self.settings.groups_per_batch:
            group = await self._next_scored()
            if self._lost_lineage(group):
                self.groups.drop(group.group_id, LOST_LINEAGE, group.prompt)
                await self.pool.notify()
                continue
            age = self.version - min(group.versions)
            if age > self.settings.max_staleness:
                self.groups.drop(group.group_id, f"stale by {age} versions", group.prompt)
                await self.pool.notify()
                continue
            groups.append(group)
            staleness.append(age)
        return groups, staleness

    async def _next_batch(self) -> tuple[BatchRow, list[ScoredGroup], list[int], bool]:
        """The next step's batch: one to train again (from the ledger) if any, else a new one, which is
        on disk before the learner sees it (so its id always names the same groups)."""
        if self._replay:
            row = self._replay.popleft()
            stored = await self.store.load_scored(row.group_ids)
            missing = [gid for gid in row.group_ids if gid not in stored]
            if missing:
                raise RuntimeError(f"batch {row.batch_id}: the ledger lacks scored groups {missing}")
            groups = [stored[gid] for gid in row.group_ids]
            return row, groups, [row.train_version - min(g.versions) for g in groups], True
        groups, staleness = await self._collect_batch()
        row = BatchRow(self.step, f"step-{self.step}", self.version, tuple(g.group_id for g in groups))
        self._batches[row.step] = row
        await self.store.commit_batch(row)
        return row, groups, staleness, False

    async def _train(self) -> None:
        """Batch → train step → the step's sync, probe and row, which run behind the next step
        (`step_sync.py`: the learner waits only for its own part of the sync)."""
        cfg = self.settings
        while not cfg.max_steps or self.step < cfg.max_steps:
            row, groups, staleness, retrained = await self._next_batch()
            batch = build_train_batch(groups, row.step, row.batch_id, self.advantage_mode)
            step_started = time.perf_counter()
            try:
                result = await self.learner.train_step(batch)
            except GrpoError as exc:
                if not exc.unreachable:
                    raise
                self._replay.appendleft(row)  # sent again under its id, unless the learner trained it
                await self.step_sync.settle()
                await self._learner_lost(exc)
                continue
            step_ended = time.perf_counter()
            train_ms = (step_ended - step_started) * 1e3
            self.timeline.span(
                LEARNER, "train step", step_started, step_ended,
                step=result.step, version=result.weight_version, groups=len(groups),
            )  # fmt: skip
            # before the loop runs anything else: admission reads the version with the pipeline's size
            self.version, self.step = result.weight_version, result.step
            self._acknowledge(row, self._learner_instance, result.weight_version)
            await self.pool.notify()
            self._staleness_total += sum(staleness)
            self._staleness_groups += len(staleness)
            await self._settle()
            job = partial(self._finish_step, groups, staleness, result, train_ms, retrained)
            if not await self.step_sync.start(job):  # the learner went away during the sync (or it failed)
                await self._settle()
            # let the groups in flight run before the next batch is assembled: one step's bookkeeping
            # and the next batch's assembly in a single slice of the loop would hold them both up
            await asyncio.sleep(0)
        await self._settle()

    async def _settle(self) -> None:
        """The last step's sync and row done (its failure raised here); a learner it lost, waited for."""
        lost = await self.step_sync.settle()
        if lost is not None:
            await self._learner_lost(lost)

    async def _finish_step(
        self,
        groups: list[ScoredGroup],
        staleness: list[int],
        result: StepResult,
        train_ms: float,
        retrained: bool,
        learner_free: asyncio.Future[bool],
    ) -> GrpoError | None:
        """A trained step's sync and probe (`learner_free` resolves once the learner may train on), its
        evaluation and metrics row; the learner error the sync met, if any."""
        cfg, lost = self.settings, None
        async with self.syncer.lock:
            try:
                sync, holding = await self.step_sync.sync(result.weight_version, learner_free)
            except GrpoError as exc:  # the learner went away after training: the step stands
                if not exc.unreachable:
                    raise
                lost, sync, holding = exc, SyncResult.nothing(result.weight_version), 0
        await self.pool.notify()
        record = step_record(
            groups, staleness, result, **sync.record(),
            weight_transport=cfg.weight_transport.value,
            logprob_abs_diff_max=self.step_sync.last_alignment,
            tokens_per_s=self.groups.tokens.take(),
            groups_dropped=self.ledger.counts()["dropped"],
            train_ms=train_ms,
            rollouts_synced=holding,  # healthy rollouts on this version after the step's sync
            retrained=retrained,
        )  # fmt: skip
        filtered, self.groups.filtered = self.groups.filtered, 0
        record["filtered_groups"] = filtered
        record["filtered_fraction"] = filtered / (filtered + len(groups))
        if cfg.eval_every and result.step % cfg.eval_every == 0 and lost is None:
            try:
                with self.timeline.timed(EVALUATE, "evaluate", version=result.weight_version):
                    record.update(await self.evaluator.run(result.weight_version))
            except GrpoError as exc:  # a peer restarting: skip this evaluation, not the run
                log.warning("evaluation skipped", error=str(exc))
                record["eval_error"] = str(exc)
        assert self._metrics is not None
        self._metrics.write(record)
        observe_step(record, staleness)
        log.info(
            "step",
            step=result.step,
            reward=round(record["reward_mean"], 4),
            loss=round(record["loss"], 5),
            sync_ms=round(sync.total_ms, 1),
            diff=record["logprob_abs_diff_max"],
        )
        return lost

    async def _learner_lost(self, exc: GrpoError) -> None:
        """The learner stopped answering: wait for it (a supervisor restarts it). The same process
        again: carry on (a batch it did not acknowledge is sent again under its id). A restarted one:
        plan from the ledger, which re-trains what its checkpoint lacks and moves the rollouts back."""
        started = time.monotonic()
        log.warning("learner unreachable: waiting for it to come back", error=str(exc))
        state = await patiently(self.settings.recovery, "learner", self.learner.state)
        if state.instance_id == self._learner_instance:
            return
        if self._lineage and state.lineage_id != self._lineage:
            raise LedgerMismatch(
                f"the learner came back with lineage {state.lineage_id}, not this run's {self._lineage} "
                "(was it restarted without its checkpoint directory?)"
            )
        await self.store.flush()
        plan = plan_recovery(await self.store.snapshot(), state)
        self._learner_instance = state.instance_id
        async with self.syncer.lock:
            lost_at = self.version
            self.version, self.step = state.weight_version, state.step
            await self._apply_learner_plan(plan, state, rewound_from=plan.rewound_from)
            sync, _ = await self.step_sync.sync(self.version)
        await self.pool.notify()
        stall_s = time.monotonic() - started
        self.store.event(
            "learner_restart", stall_s=stall_s, lost_at_version=lost_at, version=state.weight_version,
            retrain=[b.step for b in plan.replay], instance=state.instance_id,
        )  # fmt: skip
        log.warning(
            "learner restarted: run continues",
            stall_s=round(stall_s, 1),
            version=state.weight_version,
            was=lost_at,
            retrain=len(plan.replay),
            synced=sync.synced,
        )

    async def _log_eval_only(self) -> None:
        record = {"step": self.step, "weight_version": self.version, "eval_only": True}
        record.update(await self.evaluator.run(self.version))
        assert self._metrics is not None
        self._metrics.write(record)

    async def _flush_ledger(self) -> None:
        """Write the ledger's queued changes in the background (batches are written before training)."""
        while True:
            await asyncio.sleep(self.settings.recovery.ledger_flush_interval)
            await self.store.flush()

    async def _monitor_health(self) -> None:
        """Poll rollouts; bring healthy ones that lag (restarted or newly registered) up to date."""
        while True:
            await asyncio.sleep(self.settings.health_interval_seconds)
            await self.catch_up()

    async def catch_up(self) -> None:
        """One health round: refresh every rollout, then sync the healthy ones behind the run's version."""
        await self.pool.refresh_all(self.version)
        lagging = [h for h in self.pool.healthy() if h.version < self.version or h.needs_sync]
        if lagging and not self.syncer.lock.locked() and not self.step_sync.busy:
            async with self.syncer.lock:
                log.info("catching up rollouts", rollouts=[h.name for h in lagging], version=self.version)
                try:
                    await self.syncer.sync(lagging)
                except GrpoError as exc:
                    log.warning("catch-up sync failed", error=str(exc))

    # ---- control and status ------------------------------------------------------------------------

    def register_rollout(self, address: str) -> str:
        """Add a rollout; the health monitor syncs it to the current version before it gets work."""
        return self.pool.add(address, registered=True).address

    @property
    def paused(self) -> bool:
        return self.groups.paused

    def pause(self, paused: bool) -> None:
        """Stop (or restart) issuing new groups; in-flight groups still finish and train."""
        self.groups.pause(paused)

    def status(self) -> SchedulerStatus:
        return SchedulerStatus(
            learner_version=self.version,
            step=self.step,
            paused=self.paused,
            finished=self.finished,
            max_steps=self.settings.max_steps,
            groups_by_state=self.ledger.counts(),
            queue_depths={
                "prompts": self.groups.prompts.qsize(),
                "reissue": len(self.groups.reissue),
                "scored": self.groups.scored.qsize() + len(self.recovered),
            },
            rollouts=[
                RolloutStatus(h.rollout_id, h.address, h.version, h.in_flight, h.max_in_flight, h.healthy)
                for h in self.pool.handles()
            ],
            staleness_mean=self._staleness_total / max(1, self._staleness_groups),
            logprob_abs_diff_max=self.step_sync.last_alignment,
            error=self.error,
            weight_transport=self.settings.weight_transport.value,
            uptime_seconds=time.monotonic() - self._born,
            **(self._metrics.status_fields() if self._metrics is not None else {}),
        )
