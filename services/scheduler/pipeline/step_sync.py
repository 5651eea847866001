"""The sync that follows each train step, run behind the learner's next step.

    trainer    train s ─▶ prepare v, learner scores the probe ─▶ train s+1 ─▶ …
    step sync                                  └─▶ stage v, commit v, release v, rollouts score, row

After a step the learner's own part of the sync is short: pack the new version (its own copy from
then on, or for a broadcast a push queued on its model thread ahead of any later step) and score the
probe sequence at that version. The rollouts' part (stage, commit, release, their probe answers) and
the step's evaluation and metrics row need nothing more of the learner, so the trainer sends the next
step as soon as `learner_free` resolves. Measured on the tiny model: the rollouts' probe alone was
~33 ms of a ~150 ms step while the learner waited; on ~29M, commit + probe ~0.35 s of ~10 s.

One job at a time: the trainer `settle`s the previous job before the next sync (and before recovery),
so syncs never overlap, rows are written in step order, and a misalignment found on version v stops
the run before v + 1 is synced (the learner will have trained one step past v). Between steps, the
health monitor's rounds (`catch_up`) bring rollouts that (re)joined or fell behind up to the version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from services.common.errors import FailedPrecondition, GrpoError
from services.common.logging import get_logger
from services.scheduler.observe.timeline import SYNC, Timeline
from services.scheduler.peers.clients import EnvClient
from services.scheduler.peers.rollouts import RolloutPool
from services.scheduler.pipeline.alignment import Alignment, AlignmentProbe
from services.scheduler.pipeline.intake import ExternalIntake
from services.scheduler.pipeline.weight_sync import SyncResult, WeightSyncer

log = get_logger(__name__)

# A step's remaining work: given `learner_free`, it resolves it (True: the learner may train on) and
# returns the learner error it met after training (the learner went away), if any.
StepJob = Callable[[asyncio.Future[bool]], Awaitable[GrpoError | None]]


class StepSync:
    """Syncs and probes the rollouts after each step; runs each step's job behind the next step."""

    def __init__(
        self,
        syncer: WeightSyncer,
        alignment: AlignmentProbe,
        pool: RolloutPool,
        timeline: Timeline | None = None,
    ) -> None:
        self.syncer, self.alignment, self.pool = syncer, alignment, pool
        self.timeline = timeline or Timeline()
        self.last_alignment = Alignment()  # the latest probe's (NaN: skipped)
        self.job: asyncio.Task[GrpoError | None] | None = None

    async def first_check(self, env: EnvClient, version: int) -> Alignment:
        """Before training: make the probe sequence, then check every healthy rollout against the
        learner at `version`."""
        await self.alignment.make(env, self.pool, version)
        self.last_alignment = await self.alignment.check(self.pool.healthy(), version)
        return self.last_alignment

    async def first_check_external(self, intake: ExternalIntake, version: int) -> Alignment:
        """`first_check` for source = external: the probe is the first submitted group's first
        sequence (waited for: the run trains nothing before it)."""
        if intake.first_group is None:
            log.info("waiting for the first external group (the alignment probe is made from it)")
        await intake.first.wait()
        assert intake.first_group is not None
        self.alignment.make_from(intake.first_group)
        self.last_alignment = await self.alignment.check(self.pool.healthy(), version)
        return self.last_alignment

    async def sync(
        self, version: int, learner_free: asyncio.Future[bool] | None = None
    ) -> tuple[SyncResult, int]:
        """Bring the rollouts behind `version` to it and probe every rollout holding it; the sync and
        the number of healthy rollouts on `version` after it. Caller holds the syncer's lock.

        The learner packs the version and scores the probe at once (both on its model thread, ahead of
        any later step); then `learner_free` resolves True and the rollouts stage, commit and score."""
        # a health round may have caught some up to this version while the learner trained: never
        # stage a version on a rollout that holds it (for nccl it would not join the broadcast)
        behind = self.pool.behind(version)
        scoring = asyncio.create_task(self.alignment.score_learner())
        try:
            pending = await self.syncer.prepare(behind) if behind else None
        except FailedPrecondition as exc:
            # the learner cannot publish now (cuda_ipc: every buffer may still be read by a rollout
            # cut off from us): training goes on; the next step's sync or a health round tries again
            log.warning(
                "weight sync deferred: the learner cannot publish now", version=version, error=str(exc)
            )
            pending = None
        except BaseException:
            scoring.cancel()
            raise
        # a broadcast (nccl) holds the learner's model thread until the rollouts receive it in stage:
        # the rollouts stage while the learner scores
        completing = asyncio.create_task(self.syncer.complete(pending)) if pending else None
        (learner,) = await asyncio.gather(scoring, return_exceptions=True)
        if learner_free is not None and not isinstance(learner, BaseException):
            learner_free.set_result(True)
        result = await completing if completing else SyncResult.nothing(version)
        if isinstance(learner, BaseException):
            raise learner
        holding = self.pool.holding(version)
        with self.timeline.timed(SYNC, "probe", version=version, rollouts=len(holding)):
            self.last_alignment = await self.alignment.check(holding, version, learner)
        return result, len(holding)

    async def catch_up(self, version: int) -> None:
        """One health round: refresh every rollout, then sync the healthy ones behind `version`, unless
        a sync runs (a step's job syncs every rollout behind the learner anyway)."""
        await self.pool.refresh_all(version)
        lagging = self.pool.lagging(version)
        if lagging and not self.syncer.lock.locked() and not self.busy:
            async with self.syncer.lock:
                log.info("catching up rollouts", rollouts=[h.name for h in lagging], version=version)
                try:
                    await self.syncer.sync(lagging)
                except GrpoError as exc:
                    log.warning("catch-up sync failed", error=str(exc))

    @property
    def busy(self) -> bool:
        """A step's job runs: it will sync every rollout behind the learner (health rounds leave them)."""
        return self.job is not None and not self.job.done()

    async def start(self, job: StepJob) -> bool:
        """Run `job` in the background (the previous one settled); True once the learner may train on,
        False if the job ended before that (the learner went away, or the job failed: `settle` says)."""
        assert self.job is None, "settle() the previous step first"
        learner_free: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        async def run() -> GrpoError | None:
            try:
                return await job(learner_free)
            finally:
                if not learner_free.done():
                    learner_free.set_result(False)

        self.job = asyncio.create_task(run(), name="step-sync")
        return await learner_free

    async def settle(self) -> GrpoError | None:
        """Wait for the last job: its failure is raised here, the learner error it met returned."""
        job, self.job = self.job, None
        return None if job is None else await job
