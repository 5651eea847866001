"""The central asyncio loop of a run.

Four cooperating tasks, joined by bounded queues:

    prompt feeder ──prompts──▶ dispatcher ──(a task per group)──▶ generate ▶ score ──scored──▶ trainer
    (env.sample)               (admission, least-loaded rollout)    (rollout)  (env)     (learner step, sync)
    health monitor: polls rollouts, brings lagging or (re)joined ones up to the current version.

Every group is tracked in the ledger; a group whose rollout dies is dropped and its prompt re-issued,
so a dead worker costs time, never data. The peers are the protocols of `clients.py`: this module
builds no request message and handles no status code (a failure's `retryable` and `unreachable` say
everything the policy needs).
"""

from __future__ import annotations

import asyncio
import math
import operator
import statistics
import time
import uuid
from collections import deque
from dataclasses import dataclass

from grpo.common.v1 import types_pb2
from services.common.advantages import MODE_FOR_LOSS, AdvantageMode
from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.scheduler.clients import EnvClient, LearnerClient, Sampling, ScoredGroup, StepResult
from services.scheduler.config import SchedulerSettings
from services.scheduler.evaluation import Evaluator
from services.scheduler.ledger import GroupLedger, GroupState
from services.scheduler.metrics import MetricsLog, TokenRate
from services.scheduler.policy import build_train_batch, expected_train_version
from services.scheduler.rollouts import RolloutHandle, RolloutPool
from services.scheduler.weight_sync import AlignmentError, SyncResult, WeightSyncer

log = get_logger(__name__)

# A prompt whose group failed this many times is given up (logged and counted as dropped).
MAX_ATTEMPTS = 5

_BY_INDEX = operator.attrgetter("index")


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
        self.ledger = GroupLedger()
        self.syncer = WeightSyncer(learner, pool, settings.weight_transport)
        self.evaluator = Evaluator(settings, env, pool)
        batch = settings.groups_per_batch
        self.prompts: asyncio.Queue[types_pb2.Prompt] = asyncio.Queue(maxsize=settings.prompt_buffer)
        self._prompt_chunk = min(settings.prompt_buffer, max(1, settings.groups_per_batch))
        self._prompt_room = asyncio.Event()  # set when the buffer has room for another chunk
        self.reissue: deque[types_pb2.Prompt] = deque()
        self.scored: asyncio.Queue[ScoredGroup] = asyncio.Queue(maxsize=(settings.max_staleness + 1) * batch)
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
            await self._prepare()
            background = [
                asyncio.create_task(self._feed_prompts(), name="feeder"),
                asyncio.create_task(self._dispatch(), name="dispatcher"),
                asyncio.create_task(self._monitor_health(), name="health"),
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
            self._metrics.close()

    async def _prepare(self) -> None:
        """Learn the learner's version and loss, bring every rollout to it, fix the probe sequence."""
        state = await self.learner.state()
        self.version, self.step = state.weight_version, state.step
        if self.advantage_mode == "auto":
            self.advantage_mode = MODE_FOR_LOSS.get(state.loss, AdvantageMode.group_std)
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
        if self.settings.eval_every:
            await self._log_eval_only()

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
        the feeder wakes once per chunk taken, not once per prompt."""
        chunk = self._prompt_chunk
        while True:
            while self.prompts.maxsize - self.prompts.qsize() >= chunk:
                for prompt in await self.env.sample(chunk, "train"):
                    await self.prompts.put(prompt)
            self._prompt_room.clear()
            await self._prompt_room.wait()

    async def _next_prompt(self) -> types_pb2.Prompt:
        if self.reissue:
            return self.reissue.popleft()
        prompt = await self.prompts.get()
        if self.prompts.maxsize - self.prompts.qsize() >= self._prompt_chunk:
            self._prompt_room.set()
        return prompt

    async def _dispatch(self) -> None:
        cfg = self.settings
        while True:
            await self.resumed.wait()
            handle = await self.pool.acquire(
                lambda: expected_train_version(self.version, self.ledger.in_pipeline(), cfg.groups_per_batch),
                cfg.max_staleness,
            )
            prompt = await self._next_prompt()
            record = self.ledger.issue(prompt.id, self.version)
            record.rollout_id = handle.name
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
        self.ledger.advance(group_id, GroupState.GENERATED)
        self.tokens.add(tokens)
        try:
            scores = await self.env.score(prompt, completions)
        except GrpoError as exc:
            self._fail_group(group_id, prompt, "env", exc)
            return
        if scores.skip_group:  # the env's failure policy: a reward could not be computed
            reasons = "; ".join(i.failure for i in scores.reward_infos if not i.ok)
            self._drop(group_id, f"scoring failed: {reasons}")
            return
        self.ledger.advance(group_id, GroupState.SCORED)
        await self.scored.put(
            ScoredGroup(group_id, prompt, completions, scores.rewards, scores.reward_infos, versions)
        )

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
        self._drop(group_id, reason)
        if retry:
            self.reissue.append(prompt)

    def _drop(self, group_id: str, reason: str) -> None:
        record = self.ledger.get(group_id)
        if record.state not in (GroupState.TRAINED, GroupState.DROPPED):
            self.ledger.advance(group_id, GroupState.DROPPED, reason)

    # ---- training and weight sync ----------------------------------------------------------------

    async def _collect_batch(self) -> tuple[list[ScoredGroup], list[int]]:
        """B groups within the staleness bound; late ones are dropped and their prompts re-issued."""
        groups, staleness = [], []
        while len(groups) < self.settings.groups_per_batch:
            group = await self.scored.get()
            age = self.version - min(group.versions)
            if age > self.settings.max_staleness:
                self._drop(group.group_id, f"stale by {age} versions")
                self.reissue.append(group.prompt)
                await self.pool.notify()
                continue
            groups.append(group)
            staleness.append(age)
        return groups, staleness

    async def _train(self) -> None:
        cfg = self.settings
        while not cfg.max_steps or self.step < cfg.max_steps:
            groups, staleness = await self._collect_batch()
            batch = build_train_batch(groups, self.step, f"step-{self.step}", self.advantage_mode)
            step_started = time.perf_counter()
            result = await self.learner.train_step(batch)
            train_ms = (time.perf_counter() - step_started) * 1e3
            for group in groups:
                self.ledger.advance(group.group_id, GroupState.TRAINED)
            await self.pool.notify()
            self._staleness_total += sum(staleness)
            self._staleness_groups += len(staleness)
            async with self.syncer.lock:
                self.version, self.step = result.weight_version, result.step
                # a health round may have caught some up to this version while we trained: never
                # stage a version on a rollout that holds it (for nccl it would not join the broadcast)
                behind = self.pool.behind(self.version)
                sync = await self.syncer.sync(behind) if behind else SyncResult.nothing(self.version)
                holding = len(self.pool.healthy()) - len(self.pool.behind(self.version))
                self.last_alignment = await self._check_alignment(
                    [h for h in self.pool.healthy() if h.version == self.version]
                )
            await self.pool.notify()
            record = self._step_record(groups, staleness, result, sync, train_ms, holding)
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                record.update(await self.evaluator.run(self.version))
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
            # let the groups in flight run before the next batch is assembled: one step's bookkeeping
            # and the next batch's assembly in a single slice of the loop would hold them both up
            await asyncio.sleep(0)

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
