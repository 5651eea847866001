"""The central asyncio loop of a run: the scheduler's components wired together, and the train loop.

Four cooperating tasks, joined by bounded queues:

    prompt feeder ──prompts──▶ dispatcher ──(a task per group)──▶ generate ▶ score ──scored──▶ trainer
    (env.sample)               (admission, least-loaded rollout)    (rollout)  (env)     (learner step, sync)
    health monitor: polls rollouts, brings lagging or (re)joined ones up to the current version.

The feeder, dispatcher and group tasks are `pipeline/groups.py`; the trainer takes each step's batch
from `pipeline/batches.py`, and each step's sync, probe and metrics row run behind the learner's next
step (`pipeline/step_sync.py`).

Every group is tracked in the ledger, and the ledger is durable (`ledger/store.py`: SQLite in the
run directory). A group whose rollout dies is dropped and its prompt re-issued, so a dead worker
costs time, never data; an env or learner that goes away is waited for (a supervisor restarts it); a
learner that comes back from an older checkpoint is caught up by training the same batches again
(`ledger/lineage.py`, `ledger/recovery.py`); a restarted scheduler continues from the ledger, and
a learner ahead of it (the ledger's last writes lost to a power loss) first goes back to a checkpoint
the ledger accounts for. The peers are the protocols of `peers/clients.py`: this module builds no
request message and handles no status code (a failure's `retryable` and `unreachable` say everything
the policy needs).
"""

from __future__ import annotations

import asyncio
import time
from functools import partial

from services.common.advantages import MODE_FOR_LOSS, AdvantageMode
from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.ledger.group_ledger import GroupLedger
from services.scheduler.ledger.lineage import Lineage
from services.scheduler.ledger.recovery import (
    RecoveryPlan,
    check_restored,
    learner_ahead,
    ledger_steps,
    left_paused,
)
from services.scheduler.ledger.store import LedgerStore, Snapshot, new_run_id
from services.scheduler.observe.status import RolloutStatus, SchedulerStatus
from services.scheduler.observe.timeline import LEARNER, Timeline
from services.scheduler.peers.clients import EnvClient, LearnerClient, LearnerInfo, StepResult
from services.scheduler.peers.patience import patiently
from services.scheduler.peers.rollouts import RolloutPool
from services.scheduler.pipeline.alignment import Alignment, AlignmentProbe
from services.scheduler.pipeline.batches import BatchAssembler, PlannedBatch
from services.scheduler.pipeline.curriculum import LevelStats
from services.scheduler.pipeline.episodes import EpisodeRunner
from services.scheduler.pipeline.evaluation import Evaluator
from services.scheduler.pipeline.groups import GroupPipeline
from services.scheduler.pipeline.intake import ExternalIntake
from services.scheduler.pipeline.policy import build_train_batch
from services.scheduler.pipeline.step_report import StepReport
from services.scheduler.pipeline.step_sync import StepSync
from services.scheduler.pipeline.weight_sync import SyncResult, WeightSyncer

log = get_logger(__name__)


class Orchestrator:
    def __init__(
        self, settings: SchedulerSettings, env: EnvClient | None, learner: LearnerClient, pool: RolloutPool
    ) -> None:
        self.settings = settings
        self.env, self.learner, self.pool = env, learner, pool
        self.store = LedgerStore(settings.run_dir)
        self.ledger = GroupLedger(sink=self.store.group_changed)
        self.timeline = Timeline()  # records once the run starts with `trace` on
        self.lineage = Lineage(self.ledger, self.store, pool)
        self.syncer = WeightSyncer(learner, pool, settings.weight_transport, self.timeline)
        self.alignment = AlignmentProbe(settings, self.syncer)
        self.step_sync = StepSync(self.syncer, self.alignment, pool, self.timeline)
        self.episodes = EpisodeRunner(settings, env)
        self.groups = GroupPipeline(
            settings, env, pool, self.ledger, self.store, lambda: self.version,
            lambda: self.lineage.generation, self.timeline, self.episodes,
        )  # fmt: skip
        self.batches = BatchAssembler(settings, self.groups, self.lineage, self.store, pool)
        # source = external: groups come from SubmitGroups (no env service; `env` is None)
        self.intake = ExternalIntake(
            settings, self.groups, self.ledger, self.store, lambda: self.version,
            lambda: self.lineage.generation,
        )  # fmt: skip
        self.evaluator = Evaluator(settings, env, pool, self.episodes)
        self.report = StepReport(settings, self.groups, self.ledger, self.evaluator, self.timeline)
        self.version = 0
        self.step = 0
        self.finished = False
        self.error = ""
        self.advantage_mode = settings.advantage_mode
        self._born = time.monotonic()
        self.run_id = ""  # the ledger's, once the run is prepared
        self._pause_asked = False

    # ---- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Train until max_steps (or cancellation). Records a failure in `self.error` and re-raises."""
        background = []
        self.report.open()
        if self.settings.trace:
            self.timeline.open(self.settings.run_dir / "trace.json")
        try:
            resumed = await self._prepare(await self.store.open())
            # health rounds first: a rollout taken out of work by a missed probe comes back through
            # them, and the step-0 evaluation needs a rollout
            background = [asyncio.create_task(self._monitor_health(), name="health")]
            if self.settings.eval_every and not resumed:
                await self.report.evaluate_only(self.step, self.version)
            await self.report.track(self.run_id)
            if self.env is not None:  # source = external: the intake takes SubmitGroups instead
                background += [
                    asyncio.create_task(self.groups.feed(), name="feeder"),
                    asyncio.create_task(self.groups.dispatch(), name="dispatcher"),
                ]
            background += [
                asyncio.create_task(self._flush_ledger(), name="ledger"),
                asyncio.create_task(self.pool.pause_watch.run(), name="pause-watch"),
            ]
            trainer = asyncio.create_task(self._train(), name="trainer")
            background.append(trainer)  # cancelled with the rest when the run is (`finally`)
            # Whichever ends first: the trainer (done/failed) or a background task crashing.
            done, _ = await asyncio.wait(background, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            if trainer not in done:
                raise RuntimeError("a scheduler task stopped unexpectedly")
            self.finished = True
            self.store.event("run_finished", step=self.step, version=self.version)  # run_record.py reads
            log.info("run finished", steps=self.step, version=self.version)
        except asyncio.CancelledError:
            self.store.event("run_stopped", step=self.step, version=self.version)
            raise
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.store.event("run_failed", step=self.step, version=self.version, error=self.error)
            log.exception("run failed", error=self.error)
            raise
        finally:
            # cancelled before anything is awaited here: the trainer (a task of its own, which
            # cancelling `run` does not reach) must not train a step after the ending is recorded
            in_flight = [*self.groups.tasks, *([self.step_sync.job] if self.step_sync.job else [])]
            for task in [*background, *in_flight]:
                task.cancel()
            await self.intake.close()
            await asyncio.gather(*background, *in_flight, return_exceptions=True)
            await self.store.close()
            self.report.close()
            await asyncio.to_thread(self.timeline.close)

    async def _prepare(self, snapshot: Snapshot) -> bool:
        """Learn the learner's version and loss, continue from the ledger if it holds an earlier
        incarnation's run, bring every rollout to the learner's version, fix the probe sequence.
        Whether the run resumed."""
        # a peer may still be (re)starting: a restarted scheduler must not fail on a learner loading
        state = await patiently(self.settings.recovery, "learner", self.learner.state)
        if self.env is not None:
            self.episodes.info = info = await patiently(self.settings.recovery, "env", self.env.describe)
            if info.max_turns > 1:
                log.info("multi-turn environment", env=info.name, max_turns=info.max_turns)
                self.alignment.multi_turn = True
            self._levels(info.levels, info.success_threshold, snapshot)
        elif self.settings.curriculum.enabled:
            raise ValueError("curriculum.enabled needs the env service (source = env) and its levels")
        discarded = 0
        if not snapshot.empty and learner_ahead(snapshot, state):
            self.lineage.check(snapshot, state)  # another run's ledger: refused before anything goes back
            discarded, state = state.weight_version, await self._go_back(snapshot, state)
        self.version, self.step = state.weight_version, state.step
        self.lineage.start(state)
        if self.advantage_mode == "auto":
            self.advantage_mode = MODE_FOR_LOSS.get(state.loss, AdvantageMode.group_std)
        resumed = not snapshot.empty
        self.run_id = snapshot.meta.get("run_id") or new_run_id()
        if resumed:
            await self._resume(snapshot, state, discarded)
        else:
            cfg = self.settings
            self.store.set_meta(
                run_id=self.run_id, lineage_id=state.lineage_id, group_size=cfg.group_size,
                groups_per_batch=cfg.groups_per_batch, max_staleness=cfg.max_staleness, generation=0,
                first_step=state.step,
            )  # fmt: skip
        if resumed and not self._pause_asked and left_paused(snapshot):
            self.groups.pause(True)  # paused before the restart: still paused (Resume goes on)
            log.info("the run was paused before this restart: it stays paused until Resume")
        self.store.event("scheduler_start", step=self.step, version=self.version, resumed=resumed)
        await self.store.flush()
        recovery = self.settings.recovery  # a rollout may still be (re)starting
        await self.pool.wait_for_healthy(self.version, recovery.peer_restart_timeout, recovery.retry_interval)
        async with self.syncer.lock:
            lagging = self.pool.behind(self.version)
            if lagging:
                await self.syncer.sync(lagging)
        if self.env is None:  # the probe is the first external group's first sequence
            self.intake.open()
            diff = await self.step_sync.first_check_external(self.intake, self.version)
        else:
            diff = await self.step_sync.first_check(self.env, self.version)
        log.info(
            "ready to train", version=self.version, mode=self.advantage_mode,
            logprob_abs_diff_max=diff.sampled, logprob_abs_diff_max_env=diff.env,
        )  # fmt: skip
        return resumed

    def _levels(self, levels: tuple[str, ...], threshold: float, snapshot: Snapshot) -> None:
        """Track an env's difficulty levels (and with the curriculum on, draw by them), the success
        rates rebuilt from the ledger and each level's stream continued after its last position."""
        curriculum = self.settings.curriculum
        if not levels:
            if curriculum.enabled:
                raise ValueError("curriculum.enabled needs an environment that declares difficulty levels")
            return
        self.groups.levels = stats = LevelStats(levels, curriculum, threshold)
        if curriculum.enabled:  # positions are taken per level (the audit checks each level's stream)
            self.store.set_meta(level_count=len(levels))
        stats.rebuild(snapshot.level_outcomes)
        self.groups.resume_levels(g.position for g in snapshot.groups)
        log.info("difficulty levels", levels=list(levels), curriculum=curriculum.enabled, rates=stats.rates())

    async def _go_back(self, snapshot: Snapshot, state: LearnerInfo) -> LearnerInfo:
        """The learner trained steps the ledger lost (a power loss): it goes back to a checkpoint the
        ledger accounts for (`recovery.py` states the rule) and is checked to be where the ledger is."""
        target, first = ledger_steps(snapshot), int(snapshot.meta.get("first_step", "0"))
        lineage = snapshot.meta.get("lineage_id") or state.lineage_id
        log.warning("the learner is ahead of the ledger (lost ledger writes): sending it back",
                    learner_step=state.step, ledger_steps=target)  # fmt: skip
        recovery = self.settings.recovery
        await patiently(recovery, "learner", partial(self.learner.restore, lineage, target, first))
        restored = await patiently(recovery, "learner", self.learner.state)
        check_restored(snapshot, restored)
        self.store.event(
            "learner_restore", from_step=state.step, to_step=restored.step, ledger_steps=target,
            instance=restored.instance_id,
        )  # fmt: skip
        return restored

    async def _resume(self, snapshot: Snapshot, state: LearnerInfo, discarded_version: int = 0) -> None:
        """Continue an earlier incarnation's run (ledger/recovery.py says what each part of a plan means)."""
        plan = self.lineage.resume(snapshot, state, discarded_version)
        await self._apply(plan, state)
        stored = await self.store.load_scored(plan.requeue)
        self.batches.requeue(stored[gid] for gid in plan.requeue if gid in stored)
        if stored:
            self.intake.note_first(next(iter(stored.values())))
        prompts = await self.store.load_prompts(plan.reissue)
        self.groups.resume_at(plan.next_position, [(p, prompts[p]) for p in plan.reissue if p in prompts])
        log.info(
            "resuming the run from its ledger", step=self.step, version=self.version,
            replay=[b.step for b in plan.replay], acknowledged=[b.step for b in plan.acknowledge],
            requeued=self.batches.waiting, reissued=len(plan.reissue), dropped=len(plan.drop),
            cursor=plan.next_position,
        )  # fmt: skip

    async def _apply(self, plan: RecoveryPlan, state: LearnerInfo) -> None:
        self.batches.replay(await self.lineage.apply(plan, state, self.report.metrics))

    # ---- training --------------------------------------------------------------------------------

    async def _train(self) -> None:
        """Batch → train step → the step's sync, probe and row, which run behind the next step
        (`step_sync.py`: the learner waits only for its own part of the sync)."""
        cfg = self.settings
        while not cfg.max_steps or self.step < cfg.max_steps:
            planned = await self.batches.next(self.step, self.version)
            row = planned.row
            batch = build_train_batch(planned.groups, row.step, row.batch_id, self.advantage_mode)
            step_started = time.perf_counter()
            try:
                result = await self.learner.train_step(batch)
            except GrpoError as exc:
                if not exc.unreachable:
                    raise
                self.batches.retry(row)  # sent again under its id, unless the learner trained it
                await self.step_sync.settle()
                await self._learner_lost(exc)
                continue
            step_ended = time.perf_counter()
            self.timeline.span(
                LEARNER, "train step", step_started, step_ended,
                step=result.step, version=result.weight_version, groups=len(planned.groups),
            )  # fmt: skip
            # before the loop runs anything else: admission reads the version with the pipeline's size
            self.version, self.step = result.weight_version, result.step
            self.lineage.acknowledge(row, result.weight_version)
            self.store.learner_logprobs(row.step, batch.groups, result.completion_logprobs)
            await self.pool.notify()
            self.batches.trained(planned.staleness)
            await self._settle()
            job = partial(self._finish_step, planned, result, (step_ended - step_started) * 1e3)
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
        self, planned: PlannedBatch, result: StepResult, train_ms: float, learner_free: asyncio.Future[bool]
    ) -> GrpoError | None:
        """A trained step's sync and probe (`learner_free` resolves once the learner may train on), then
        its row (`step_report.py`); the learner error the sync met, if any."""
        lost = None
        async with self.syncer.lock:
            try:
                sync, holding = await self.step_sync.sync(result.weight_version, learner_free)
            except GrpoError as exc:  # the learner went away after training: the step stands
                if not exc.unreachable:
                    raise
                lost, sync, holding = exc, SyncResult.nothing(result.weight_version), 0
        await self.pool.notify()
        alignment = Alignment() if lost else self.step_sync.last_alignment  # no sync, no probe
        await self.report.step(planned, result, sync, holding, train_ms, alignment, evaluate=lost is None)
        return lost

    async def _learner_lost(self, exc: GrpoError) -> None:
        """The learner stopped answering: wait for it (a supervisor restarts it). The same process
        again: carry on (a batch it did not acknowledge is sent again under its id). A restarted one:
        plan from the ledger, which re-trains what its checkpoint lacks and moves the rollouts back."""
        started = time.monotonic()
        log.warning("learner unreachable: waiting for it to come back", error=str(exc))
        state = await patiently(self.settings.recovery, "learner", self.learner.state)
        plan = await self.lineage.returned(state)
        if plan is None:
            return
        async with self.syncer.lock:
            lost_at = self.version
            self.version, self.step = state.weight_version, state.step
            await self._apply(plan, state)
            sync, _ = await self.step_sync.sync(self.version)
        await self.pool.notify()
        stall_s = time.monotonic() - started
        self.store.event(
            "learner_restart", stall_s=stall_s, lost_at_version=lost_at, version=state.weight_version,
            retrain=[b.step for b in plan.replay], instance=state.instance_id,
        )  # fmt: skip
        log.warning(
            "learner restarted: run continues", stall_s=round(stall_s, 1), version=state.weight_version,
            was=lost_at, retrain=len(plan.replay), synced=sync.synced,
        )  # fmt: skip

    # ---- background --------------------------------------------------------------------------------

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
        """One health round (`StepSync.catch_up`) at the run's version."""
        await self.step_sync.catch_up(self.version)

    # ---- control and status ------------------------------------------------------------------------

    def register_rollout(self, address: str) -> str:
        """Add a rollout; the health monitor syncs it to the current version before it gets work."""
        return self.pool.add(address, registered=True).address

    @property
    def paused(self) -> bool:
        return self.groups.paused

    def pause(self, paused: bool) -> None:
        """Stop (or restart) issuing new groups; in-flight groups still finish and train. The change
        is queued for the ledger (`paused`/`resumed` events): a restarted scheduler keeps it."""
        self._pause_asked = True  # this incarnation was told: the ledger's older word does not apply
        if paused != self.paused:
            self.groups.pause(paused)
            self.store.event("paused" if paused else "resumed", step=self.step)

    async def set_paused(self, paused: bool) -> None:
        """`pause`, on disk before it returns (once the ledger is open; before, its first write)."""
        self.pause(paused)
        if self.store.is_open:
            await self.store.flush()

    def status(self) -> SchedulerStatus:
        depths = self.groups.queue_depths()
        depths["scored"] += self.batches.waiting
        return SchedulerStatus(
            learner_version=self.version,
            step=self.step,
            paused=self.paused,
            finished=self.finished,
            max_steps=self.settings.max_steps,
            groups_by_state=self.ledger.counts(),
            queue_depths=depths,
            rollouts=[
                RolloutStatus(h.rollout_id, h.address, h.version, h.in_flight, h.max_in_flight, h.healthy)
                for h in self.pool.handles()
            ],
            staleness_mean=self.batches.staleness_mean,
            logprob_abs_diff_max=self.step_sync.last_alignment.sampled,
            error=self.error,
            weight_transport=self.settings.weight_transport.value,
            source=self.settings.source,
            queue_capacity=self.intake.capacity,
            group_size=self.settings.group_size,
            groups_per_batch=self.settings.groups_per_batch,
            level_success=self.groups.levels.rates() if self.groups.levels is not None else {},
            uptime_seconds=time.monotonic() - self._born,
            **self.report.status_fields(),
        )
