"""The central asyncio loop of a run.

Four cooperating tasks, joined by bounded queues:

    prompt feeder ──prompts──▶ dispatcher ──(a task per group)──▶ generate ▶ score ──scored──▶ trainer
    (env.sample)               (admission, least-loaded rollout)    (rollout)  (env)     (learner step, sync)
    health monitor: polls rollouts, brings lagging or (re)joined ones up to the current version.

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
import math
import operator
import statistics
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from grpo.common.v1 import types_pb2
from services.common.advantages import MODE_FOR_LOSS, AdvantageMode
from services.common.errors import GrpoError, Unavailable
from services.common.logging import get_logger
from services.scheduler.clients import (
    EnvClient,
    LearnerClient,
    LearnerInfo,
    Sampling,
    ScoredGroup,
    StepResult,
)
from services.scheduler.config import SchedulerSettings
from services.scheduler.evaluation import Evaluator
from services.scheduler.ledger import GroupLedger, GroupState
from services.scheduler.metrics import MetricsLog, TokenRate
from services.scheduler.policy import build_train_batch, expected_train_version
from services.scheduler.recovery import LOST_LINEAGE, LedgerMismatch, RecoveryPlan, plan_recovery
from services.scheduler.rollouts import RolloutHandle, RolloutPool
from services.scheduler.store import BatchRow, LedgerStore, Snapshot, new_run_id
from services.scheduler.weight_sync import AlignmentError, SyncResult, WeightSyncer

log = get_logger(__name__)

# A prompt whose group failed this many times is given up (logged and counted as dropped).
MAX_ATTEMPTS = 5

_BY_INDEX = operator.attrgetter("index")
T = TypeVar("T")

# A train prompt and its position in the env's train stream (re-issued prompts keep theirs).
Drawn = tuple[int, types_pb2.Prompt]


class PeerGone(RuntimeError):
    """A peer stayed unreachable past `recovery.peer_restart_timeout`."""


@dataclass(frozen=True)
class RolloutStatus:
    rollout_id: str
    address: str
    weight_version: int
    in_flight: int
    max_in_flight: int
    healthy: bool


@dataclass(frozen=True)
class SchedulerStatus:
    """What GetStatus reports: versions, progress, queues, rollouts, alignment and errors."""

    learner_version: int
    step: int
    paused: bool
    finished: bool
    max_steps: int
    groups_by_state: dict[str, int]
    queue_depths: dict[str, int]
    rollouts: list[RolloutStatus]
    staleness_mean: float
    logprob_abs_diff_max: float
    error: str


class Orchestrator:
    def __init__(
        self, settings: SchedulerSettings, env: EnvClient, learner: LearnerClient, pool: RolloutPool
    ) -> None:
        self.settings = settings
        self.env, self.learner, self.pool = env, learner, pool
        self.store = LedgerStore(settings.run_dir)
        self.ledger = GroupLedger(sink=self.store.group_changed)
        self.syncer = WeightSyncer(learner, pool, settings.weight_transport)
        self.evaluator = Evaluator(settings, env, pool)
        batch = settings.groups_per_batch
        self.prompts: asyncio.Queue[Drawn] = asyncio.Queue(maxsize=settings.prompt_buffer)
        self._prompt_chunk = min(settings.prompt_buffer, max(1, settings.groups_per_batch))
        self._prompt_room = asyncio.Event()  # set when the buffer has room for another chunk
        self.cursor = 0  # the next train-stream position to draw (the ledger restores it)
        self.reissue: deque[Drawn] = deque()
        self.scored: asyncio.Queue[ScoredGroup] = asyncio.Queue(maxsize=(settings.max_staleness + 1) * batch)
        self.recovered: deque[ScoredGroup] = deque()  # scored groups a restart found unbatched: first in
        self._batches: dict[int, BatchRow] = {}  # every batch of the run, by step (ids only)
        self._replay: deque[BatchRow] = deque()  # batches to train (again) before new ones
        self._positions: dict[str, int] = {}  # group id → train position (until the group is terminal)
        self.generation = 0  # learner lineage generation: +1 at every rewind
        self._rewinds: list[tuple[int, int]] = []  # (generation started, version rewound to)
        self._learner_instance = ""
        self._lineage = ""
        self._filtered = 0  # groups filtered (dynamic sampling) since the last step
        s = settings.sampling
        self.sampling = Sampling(
            n=settings.group_size,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
        )
        self.version = 0
        self.step = 0
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.finished = False
        self.error = ""
        self.last_alignment = 0.0
        self._staleness_total, self._staleness_groups = 0, 0  # over every trained group (GetStatus)
        self.tokens = TokenRate()
        self.probe: types_pb2.TokenSequence | None = None
        self.advantage_mode = settings.advantage_mode
        self._group_tasks: set[asyncio.Task] = set()
        self._metrics: MetricsLog | None = None  # opened when the run starts

    # ---- lifecycle -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Train until max_steps (or cancellation). Records a failure in `self.error` and re-raises."""
        background = []
        self._metrics = MetricsLog(self.settings.run_dir)
        try:
            snapshot = await self.store.open()
            await self._prepare(snapshot)
            background = [
                asyncio.create_task(self._feed_prompts(), name="feeder"),
                asyncio.create_task(self._dispatch(), name="dispatcher"),
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
            for task in [*background, *self._group_tasks]:
                task.cancel()
            await asyncio.gather(*background, *self._group_tasks, return_exceptions=True)
            await self.store.close()
            self._metrics.close()

    async def _prepare(self, snapshot: Snapshot) -> None:
        """Learn the learner's version and loss, continue from the ledger if it holds an earlier
        incarnation's run, bring every rollout to the learner's version, fix the probe sequence."""
        state = await self.learner.state()
        self.version, self.step = state.weight_version, state.step
        self._learner_instance, self._lineage = state.instance_id, state.lineage_id
        if self.advantage_mode == "auto":
            self.advantage_mode = MODE_FOR_LOSS.get(state.loss, AdvantageMode.group_std)
        resumed = not snapshot.empty
        if resumed:
            await self._resume(snapshot, state)
        else:
            cfg = self.settings
            self.store.set_meta(
                run_id=new_run_id(),
                lineage_id=state.lineage_id,
                group_size=cfg.group_size,
                groups_per_batch=cfg.groups_per_batch,
                max_staleness=cfg.max_staleness,
                generation=0,
                first_step=state.step,
            )
            self.cursor = 0
        self.store.event("scheduler_start", step=self.step, version=self.version, resumed=resumed)
        await self.store.flush()
        await self.pool.refresh_all(self.version)
        if not self.pool.healthy():
            raise RuntimeError("no rollout is ready")
        async with self.syncer.lock:
            lagging = self.pool.behind(self.version)
            if lagging:
                await self.syncer.sync(lagging)
        self.probe = await self._make_probe()
        self.last_alignment = await self._check_alignment(self.pool.healthy())
        log.info(
            "ready to train",
            version=self.version,
            advantage_mode=self.advantage_mode,
            logprob_abs_diff_max=self.last_alignment,
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
        self._positions = {g.group_id: g.position for g in snapshot.groups}
        for group_id, reason in plan.drop:
            self.ledger.advance(group_id, GroupState.DROPPED, reason, reissue=True)
        await self._apply_learner_plan(plan, state, rewound_from=plan.rewound_from)
        stored = await self.store.load_scored(plan.requeue)
        self.recovered.extend(stored[gid] for gid in plan.requeue if gid in stored)
        prompts = await self.store.load_prompts(plan.reissue)
        self.reissue.extend((position, prompts[position]) for position in plan.reissue if position in prompts)
        self.cursor = plan.next_position
        log.info(
            "resuming the run from its ledger",
            step=self.step,
            version=self.version,
            replay=[b.step for b in plan.replay],
            acknowledged=[b.step for b in plan.acknowledge],
            requeued=len(self.recovered),
            reissued=len(self.reissue),
            dropped=len(plan.drop),
            cursor=self.cursor,
        )

    async def _apply_learner_plan(
        self, plan: RecoveryPlan, state: LearnerInfo, rewound_from: int | None
    ) -> None:
        """Acknowledge batches the learner trained unacknowledged, queue the ones to train again, and on
        a rewind start a new lineage generation whose rollouts must first go back to the learner."""
        for row in plan.acknowledge:
            groups = await self.store.load_scored(row.group_ids)
            self._acknowledge(row, state.instance_id)
            if self._metrics is not None and self._metrics.last_step < row.step + 1:
                rewards = [r for g in groups.values() for r in g.rewards]
                self._metrics.write(
                    {"step": row.step + 1, "weight_version": row.step + 1, "recovered": True,
                     "reward_mean": statistics.fmean(rewards) if rewards else float("nan")}
                )  # fmt: skip
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

    def _acknowledge(self, row: BatchRow, instance: str, version_after: int | None = None) -> None:
        """Record that the learner trained `row` (its groups trained; a re-train leaves them so)."""
        for group_id in row.group_ids:
            if self.ledger.get(group_id).state != GroupState.TRAINED:
                self.ledger.advance(group_id, GroupState.TRAINED)
            self._positions.pop(group_id, None)
        after = row.step + 1 if version_after is None else version_after  # version = step, always
        self.store.trained(row.step, row.batch_id, after, instance, self.generation)

    async def _make_probe(self) -> types_pb2.TokenSequence:
        """A fixed probe: one seeded completion of the env's first eval prompt (from the first rollout
        that answers; unreachable ones are marked unhealthy)."""
        prompt = (await self.env.sample(1, "eval", start=0))[0]
        cfg = self.settings.sampling
        sampling = Sampling(n=1, temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=1234)
        for handle in self.pool.healthy():
            try:
                completions = await handle.client.generate(f"probe-{uuid.uuid4().hex[:8]}", prompt, sampling)
            except GrpoError as exc:
                if not exc.unreachable:
                    raise
                await self.pool.mark(handle, healthy=False)
                continue
            if not completions:
                raise RuntimeError("probe generation returned nothing")
            return types_pb2.TokenSequence(
                prompt_token_ids=completions[0].prompt_token_ids,
                completion_token_ids=completions[0].completion_token_ids,
                temperature=cfg.temperature,
            )
        raise RuntimeError("no rollout answered the probe generation")

    async def _check_alignment(self, rollouts: list[RolloutHandle]) -> float:
        assert self.probe is not None
        diff = await self.syncer.probe(self.probe, rollouts)
        if diff > self.settings.alignment_threshold:
            message = (
                f"logprob misalignment after sync to v{self.version}: max |Δ| = {diff:.3g} "
                f"> threshold {self.settings.alignment_threshold:g}"
            )
            if self.settings.alignment_action == "fail":
                raise AlignmentError(message)
            log.warning(message)
        return diff

    # ---- prompts and generation ----------------------------------------------------------------------

    async def _feed_prompts(self) -> None:
        """Keep up to `prompt_buffer` prompts fetched ahead, refilled a chunk (one env call) at a time:
        the feeder wakes once per chunk taken, not once per prompt.

        The scheduler owns the train cursor: every draw names its start, so the env's own cursor (lost
        when it restarts) never matters, and the ledger restores ours."""
        chunk = self._prompt_chunk
        while True:
            while self.prompts.maxsize - self.prompts.qsize() >= chunk:
                start = self.cursor
                prompts = await self._patiently("env", partial(self.env.sample, chunk, "train", start=start))
                self.cursor = start + len(prompts)
                for offset, prompt in enumerate(prompts):
                    await self.prompts.put((start + offset, prompt))
            self._prompt_room.clear()
            await self._prompt_room.wait()

    async def _next_prompt(self) -> Drawn:
        if self.reissue:
            return self.reissue.popleft()
        drawn = await self.prompts.get()
        if self.prompts.maxsize - self.prompts.qsize() >= self._prompt_chunk:
            self._prompt_room.set()
        return drawn

    async def _patiently(self, peer: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, retried while the peer is down (UNAVAILABLE: restarting), up to the restart timeout.
        A call that merely timed out is not retried here: a hung reward or step is not a restart."""
        cfg = self.settings.recovery
        deadline = time.monotonic() + cfg.peer_restart_timeout
        while True:
            try:
                return await call()
            except Unavailable as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning(f"{peer} unreachable; retrying", error=str(exc))
                await asyncio.sleep(cfg.retry_interval)

    async def _dispatch(self) -> None:
        cfg = self.settings
        while True:
            await self.resumed.wait()
            handle = await self.pool.acquire(
                lambda: expected_train_version(self.version, self.ledger.in_pipeline(), cfg.groups_per_batch),
                cfg.max_staleness,
            )
            position, prompt = await self._next_prompt()
            record = self.ledger.issue(prompt.id, self.version, position, self.generation)
            record.rollout_id = handle.name
            if record.attempt == 0:
                self.store.prompt_issued(position, prompt)
            self._positions[record.group_id] = position
            task = asyncio.create_task(self._run_group(record.group_id, prompt, handle))
            self._group_tasks.add(task)
            task.add_done_callback(self._group_tasks.discard)
            await asyncio.sleep(0)

    async def _run_group(self, group_id: str, prompt: types_pb2.Prompt, handle: RolloutHandle) -> None:
        """Generate (rollout) → score (env) → queue for training. Failures drop the group; retryable
        ones re-issue its prompt, and only a rollout failure counts against the rollout."""
        try:
            completions, versions, tokens = await self._generate(group_id, prompt, handle)
        except GrpoError as exc:
            if exc.unreachable:
                await self.pool.mark(handle, healthy=False)
            self._fail_group(group_id, prompt, f"rollout {handle.name}", exc)
            return
        except Exception as exc:  # a broken answer from the rollout: log it, never lose the prompt
            log.exception("rollout returned an unusable group", group=group_id, rollout=handle.name)
            self._fail_group(group_id, prompt, f"rollout {handle.name}", exc)
            return
        finally:
            await self.pool.release(handle)  # the rollout is free as soon as generation ends
        self.ledger.advance(group_id, GroupState.GENERATED, versions=versions)
        self.tokens.add(tokens)
        try:  # an env that went away (restarting) is waited for: the completions are kept
            scores = await self._patiently("env", lambda: self.env.score(prompt, completions))
        except GrpoError as exc:
            self._fail_group(group_id, prompt, "env", exc)
            return
        if scores.skip_group:  # the env's failure policy: a reward could not be computed
            reasons = "; ".join(i.failure for i in scores.reward_infos if not i.ok)
            self._drop(group_id, f"scoring failed: {reasons}")
            return
        if self.settings.dynamic_sampling and max(scores.rewards) - min(scores.rewards) <= 0.0:
            self.ledger.advance(group_id, GroupState.FILTERED, "zero reward variance (dynamic sampling)")
            self._positions.pop(group_id, None)
            self._filtered += 1
            await self.pool.notify()  # it left the pipeline: admission may let another group in
            return
        self.ledger.advance(group_id, GroupState.SCORED)
        group = ScoredGroup(group_id, prompt, completions, scores.rewards, scores.reward_infos, versions)
        self.store.scored(group)
        await self.scored.put(group)

    async def _generate(
        self, group_id: str, prompt: types_pb2.Prompt, handle: RolloutHandle
    ) -> tuple[list[types_pb2.Completion], set[int], int]:
        """The group in index order, checked (indices 0..G-1, tokens stamped with weight versions), with
        the versions that produced it and its completion-token count: read once, here."""
        completions = sorted(await handle.client.generate(group_id, prompt, self.sampling), key=_BY_INDEX)
        versions: set[int] = set()
        tokens = 0
        complete = len(completions) == self.settings.group_size
        for i, c in enumerate(completions):  # one pass: every field read here is read once per group
            if c.index != i:
                complete = False
                break
            tokens += len(c.completion_token_ids)
            for span in c.version_spans:
                versions.add(span.version)
        if not complete:
            indices = [c.index for c in completions]
            raise RuntimeError(f"group {group_id}: rollout returned completion indices {indices}")
        if not versions:
            raise ValueError(f"group {group_id}: completions carry no weight-version spans")
        return completions, versions, tokens

    def _fail_group(self, group_id: str, prompt: types_pb2.Prompt, where: str, exc: Exception) -> None:
        """Drop the group; re-issue its prompt unless the failure says the request itself is bad."""
        if isinstance(exc, GrpoError):
            retry, reason = exc.retryable, f"{where}: {exc}"
        else:
            retry, reason = True, f"{where}: {type(exc).__name__}: {exc}"
        retry = retry and self.ledger.get(group_id).attempt + 1 < MAX_ATTEMPTS
        log.warning("group failed", group=group_id, reason=reason, reissue=retry)
        self._drop(group_id, reason, prompt if retry else None)

    def _drop(self, group_id: str, reason: str, reissue: types_pb2.Prompt | None = None) -> None:
        """Drop a live group; with `reissue`, its prompt goes back to the queue (same position)."""
        record = self.ledger.get(group_id)
        if record.state in (GroupState.TRAINED, GroupState.DROPPED, GroupState.FILTERED):
            return
        self.ledger.advance(group_id, GroupState.DROPPED, reason, reissue=reissue is not None)
        position = self._positions.pop(group_id, record.position)
        if reissue is not None:
            self.reissue.append((position, reissue))

    # ---- training and weight sync ----------------------------------------------------------------

    async def _next_scored(self) -> ScoredGroup:
        return self.recovered.popleft() if self.recovered else await self.scored.get()

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
                self._drop(group.group_id, LOST_LINEAGE, group.prompt)
                await self.pool.notify()
                continue
            age = self.version - min(group.versions)
            if age > self.settings.max_staleness:
                self._drop(group.group_id, f"stale by {age} versions", group.prompt)
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
                await self._learner_lost(exc)
                continue
            train_ms = (time.perf_counter() - step_started) * 1e3
            self._acknowledge(row, self._learner_instance, result.weight_version)
            await self.pool.notify()
            self._staleness_total += sum(staleness)
            self._staleness_groups += len(staleness)
            lost: GrpoError | None = None
            async with self.syncer.lock:
                self.version, self.step = result.weight_version, result.step
                try:
                    sync, holding = await self._sync_after_step()
                except GrpoError as exc:  # the learner went away after training: the step stands
                    if not exc.unreachable:
                        raise
                    lost, sync, holding = exc, SyncResult.nothing(self.version), 0
            await self.pool.notify()
            record = self._step_record(groups, staleness, result, sync, train_ms, holding)
            record["retrained"] = retrained
            record["filtered_groups"] = self._filtered
            record["filtered_fraction"] = self._filtered / (self._filtered + len(groups))
            self._filtered = 0
            if cfg.eval_every and self.step % cfg.eval_every == 0 and lost is None:
                try:
                    record.update(await self.evaluator.run(self.version))
                except GrpoError as exc:  # a peer restarting: skip this evaluation, not the run
                    log.warning("evaluation skipped", error=str(exc))
                    record["eval_error"] = str(exc)
            assert self._metrics is not None
            self._metrics.write(record)
            log.info(
                "step",
                step=self.step,
                reward=round(record["reward_mean"], 4),
                loss=round(record["loss"], 5),
                sync_ms=round(sync.total_ms, 1),
                diff=record["logprob_abs_diff_max"],
            )
            if lost is not None:
                await self._learner_lost(lost)
            # let the groups in flight run before the next batch is assembled: one step's bookkeeping
            # and the next batch's assembly in a single slice of the loop would hold them both up
            await asyncio.sleep(0)

    async def _sync_after_step(self) -> tuple[SyncResult, int]:
        """Bring the rollouts to the new version and probe them. Caller holds the syncer's lock."""
        # a health round may have caught some up to this version while we trained: never
        # stage a version on a rollout that holds it (for nccl it would not join the broadcast)
        behind = self.pool.behind(self.version)
        sync = await self.syncer.sync(behind) if behind else SyncResult.nothing(self.version)
        holding = len(self.pool.healthy()) - len(self.pool.behind(self.version))
        self.last_alignment = await self._check_alignment(
            [h for h in self.pool.healthy() if h.version == self.version]
        )
        return sync, holding

    async def _learner_lost(self, exc: GrpoError) -> None:
        """The learner stopped answering: wait for it (a supervisor restarts it). The same process
        again: carry on (a batch it did not acknowledge is sent again under its id). A restarted one:
        plan from the ledger, which re-trains what its checkpoint lacks and moves the rollouts back."""
        started = time.monotonic()
        log.warning("learner unreachable: waiting for it to come back", error=str(exc))
        state = await self._patiently("learner", self.learner.state)
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
            sync, _ = await self._sync_after_step()
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

    def _step_record(
        self,
        groups: list[ScoredGroup],
        staleness: list[int],
        result: StepResult,
        sync: SyncResult,
        train_ms: float,
        holding: int,
    ) -> dict:
        rewards = [r for g in groups for r in g.rewards]
        reward_mean = statistics.fmean(rewards)
        return {
            "step": result.step,
            "weight_version": result.weight_version,
            "reward_mean": reward_mean,
            "reward_std": math.sqrt(math.fsum((r - reward_mean) ** 2 for r in rewards) / len(rewards)),
            "loss": result.metrics.get("loss", float("nan")),
            "staleness_mean": statistics.fmean(staleness),
            "staleness_max": max(staleness),
            "sync_ms": sync.total_ms,
            "sync_prepare_ms": sync.prepare_ms,
            "sync_stage_ms": sync.stage_ms,
            "sync_commit_ms": sync.commit_ms,
            "weight_transport": self.settings.weight_transport.value,
            "logprob_abs_diff_max": self.last_alignment,
            "tokens_per_s": self.tokens.take(),
            "train_ms": train_ms,
            "groups_dropped": self.ledger.counts()["dropped"],
            "behaviour_versions": sorted(set().union(*(g.versions for g in groups))),
            "rollouts_synced": holding,  # healthy rollouts on this version after the step's sync
            **{f"learner/{k}": v for k, v in result.metrics.items()},
        }

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
        if lagging and not self.syncer.lock.locked():
            async with self.syncer.lock:
                log.info("catching up rollouts", rollouts=[h.name for h in lagging], version=self.version)
                try:
                    await self.syncer.sync(lagging)
                except GrpoError as exc:
                    log.warning("catch-up sync failed", error=str(exc))

    # ---- control and status ------------------------------------------------------------------------

    def register_rollout(self, address: str) -> str:
        """Add a rollout; the health monitor syncs it to the current version before it gets work."""
        return self.pool.add(address).address

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()

    def pause(self, paused: bool) -> None:
        """Stop (or restart) issuing new groups; in-flight groups still finish and train."""
        if paused:
            self.resumed.clear()
        else:
            self.resumed.set()

    def status(self) -> SchedulerStatus:
        return SchedulerStatus(
            learner_version=self.version,
            step=self.step,
            paused=self.paused,
            finished=self.finished,
            max_steps=self.settings.max_steps,
            groups_by_state=self.ledger.counts(),
            queue_depths={
                "prompts": self.prompts.qsize(),
                "reissue": len(self.reissue),
                "scored": self.scored.qsize(),
            },
            rollouts=[
                RolloutStatus(h.rollout_id, h.address, h.version, h.in_flight, h.max_in_flight, h.healthy)
                for h in self.pool.handles()
            ],
            staleness_mean=self._staleness_total / max(1, self._staleness_groups),
            logprob_abs_diff_max=self.last_alignment,
            error=self.error,
        )
