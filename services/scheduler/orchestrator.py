"""The central asyncio loop of a run.

Four cooperating tasks, joined by bounded queues:

    prompt feeder ──prompts──▶ dispatcher ──(a task per group)──▶ generate ▶ score ──scored──▶ trainer
    (env.SamplePrompts)        (admission, least-loaded rollout)    (rollout)  (env)     (learner step, sync)
    health monitor: polls rollouts, brings lagging or re-joined ones up to the current version.

Every group is tracked in the ledger; a group whose rollout dies is dropped and its prompt re-issued,
so a dead worker costs time, never data.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections import deque

import grpc

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2, env_pb2_grpc
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from grpo.rollout.v1 import rollout_pb2
from services.common.advantages import MODE_FOR_LOSS
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.evaluation import Evaluator
from services.scheduler.ledger import GroupLedger, GroupState
from services.scheduler.metrics import MetricsLog, TokenRate
from services.scheduler.policy import build_train_batch, expected_train_version, group_staleness
from services.scheduler.rollouts import RolloutHandle, RolloutPool
from services.scheduler.weight_sync import AlignmentError, WeightSyncer

log = get_logger(__name__)

# Rollout failures after which the prompt is re-issued elsewhere (the worker is suspect, not the prompt).
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
}
# A prompt whose group failed this many times is given up (logged and counted as dropped).
_MAX_ATTEMPTS = 5


class Orchestrator:
    def __init__(
        self,
        settings: SchedulerSettings,
        env: env_pb2_grpc.EnvironmentServiceStub,
        learner: learner_pb2_grpc.LearnerServiceStub,
        pool: RolloutPool,
    ) -> None:
        self.settings = settings
        self.env, self.learner, self.pool = env, learner, pool
        self.ledger = GroupLedger()
        self.syncer = WeightSyncer(learner, pool, settings.weight_transport, settings.timeouts)
        self.evaluator = Evaluator(settings, env, pool)
        batch = settings.groups_per_batch
        self.prompts: asyncio.Queue[types_pb2.Prompt] = asyncio.Queue(maxsize=settings.prompt_buffer)
        self.reissue: deque[types_pb2.Prompt] = deque()
        self.scored: asyncio.Queue[types_pb2.ScoredGroup] = asyncio.Queue(
            maxsize=(settings.max_staleness + 1) * batch
        )
        self.version = 0
        self.step = 0
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.finished = False
        self.error = ""
        self.last_alignment = 0.0
        self.staleness_seen: list[int] = []
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
        state = await self.learner.GetLearnerState(
            learner_pb2.GetLearnerStateRequest(), timeout=self.settings.timeouts.control
        )
        self.version, self.step = state.weight_version, state.step
        if self.advantage_mode == "auto":
            self.advantage_mode = MODE_FOR_LOSS.get(state.loss, "group_std")
        await self.pool.refresh_all()
        if not self.pool.healthy():
            raise RuntimeError("no rollout is ready")
        async with self.syncer.lock:
            lagging = [h for h in self.pool.healthy() if h.version != self.version]
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
        """A fixed probe: one sampled completion of the env's first eval prompt."""
        response = await self.env.SamplePrompts(
            env_pb2.SamplePromptsRequest(n=1, split=env_pb2.SPLIT_EVAL, start=0),
            timeout=self.settings.timeouts.control,
        )
        handle = self.pool.healthy()[0]
        sampling = types_pb2.SamplingParams(
            n=1,
            temperature=self.settings.sampling.temperature,
            top_p=1.0,
            max_tokens=self.settings.sampling.max_tokens,
            seed=1234,
        )
        request = rollout_pb2.GenerateRequest(
            request_id=f"probe-{uuid.uuid4().hex[:8]}", prompt=response.prompts[0], sampling_params=sampling
        )
        async for item in handle.stub.Generate(request, timeout=self.settings.timeouts.generate):
            c = item.completion
            return types_pb2.TokenSequence(
                prompt_token_ids=c.prompt_token_ids,
                completion_token_ids=c.completion_token_ids,
                temperature=self.settings.sampling.temperature,
            )
        raise RuntimeError("probe generation returned nothing")

    async def _check_alignment(self, rollouts: list[RolloutHandle]) -> float:
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
        chunk = min(self.settings.prompt_buffer, max(1, self.settings.groups_per_batch))
        while True:
            response = await self.env.SamplePrompts(
                env_pb2.SamplePromptsRequest(n=chunk, split=env_pb2.SPLIT_TRAIN),
                timeout=self.settings.timeouts.control,
            )
            for prompt in response.prompts:
                await self.prompts.put(prompt)

    async def _next_prompt(self) -> types_pb2.Prompt:
        if self.reissue:
            return self.reissue.popleft()
        return await self.prompts.get()

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
            record.rollout_id = handle.rollout_id
            task = asyncio.create_task(self._run_group(record.group_id, prompt, handle))
            self._group_tasks.add(task)
            task.add_done_callback(self._group_tasks.discard)

    async def _run_group(self, group_id: str, prompt: types_pb2.Prompt, handle: RolloutHandle) -> None:
        """Generate (rollout) → score (env) → queue for training. Failures drop the group; retryable
        ones re-issue its prompt, and only a rollout failure counts against the rollout."""
        try:
            completions = await self._generate(group_id, prompt, handle)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                await self.pool.mark(handle, healthy=False)
            self._fail_group(group_id, prompt, f"rollout {handle.rollout_id}", exc)
            return
        except Exception as exc:  # a broken answer from the rollout: log it, never lose the prompt
            log.exception("rollout returned an unusable group", group=group_id, rollout=handle.rollout_id)
            self._fail_group(group_id, prompt, f"rollout {handle.rollout_id}", exc)
            return
        finally:
            await self.pool.release(handle)  # the rollout is free as soon as generation ends
        self.ledger.advance(group_id, GroupState.GENERATED)
        tokens = sum(len(c.completion_token_ids) for c in completions)
        self.tokens.add(tokens)
        try:
            scores = await self.env.ScoreCompletions(
                env_pb2.ScoreCompletionsRequest(prompt=prompt, completions=completions),
                timeout=self.settings.timeouts.score,
            )
        except grpc.aio.AioRpcError as exc:
            self._fail_group(group_id, prompt, "env", exc)
            return
        if scores.skip_group:  # the env's failure policy: a reward could not be computed
            reasons = "; ".join(i.failure for i in scores.reward_infos if not i.ok)
            self._drop(group_id, f"scoring failed: {reasons}")
            return
        self.ledger.advance(group_id, GroupState.SCORED)
        group = types_pb2.ScoredGroup(
            group_id=group_id,
            prompt=prompt,
            completions=completions,
            rewards=scores.rewards,
            reward_infos=scores.reward_infos,
        )
        await self.scored.put(group)

    def _fail_group(self, group_id: str, prompt: types_pb2.Prompt, where: str, exc: Exception) -> None:
        """Drop the group; re-issue its prompt unless the failure says the request itself is bad."""
        if isinstance(exc, grpc.aio.AioRpcError):
            reason, retry = f"{where}: {exc.code().name}: {exc.details()}", exc.code() in _RETRYABLE
        else:
            reason, retry = f"{where}: {type(exc).__name__}: {exc}", True
        retry = retry and self.ledger.get(group_id).attempt + 1 < _MAX_ATTEMPTS
        log.warning("group failed", group=group_id, reason=reason, reissue=retry)
        self._drop(group_id, reason)
        if retry:
            self.reissue.append(prompt)

    async def _generate(
        self, group_id: str, prompt: types_pb2.Prompt, handle: RolloutHandle
    ) -> list[types_pb2.Completion]:
        s = self.settings.sampling
        sampling = types_pb2.SamplingParams(
            n=self.settings.group_size,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
        )
        request = rollout_pb2.GenerateRequest(request_id=group_id, prompt=prompt, sampling_params=sampling)
        completions = [
            item.completion
            async for item in handle.stub.Generate(request, timeout=self.settings.timeouts.generate)
        ]
        indices = sorted(c.index for c in completions)
        if indices != list(range(self.settings.group_size)):
            raise RuntimeError(f"group {group_id}: rollout returned completion indices {indices}")
        return sorted(completions, key=lambda c: c.index)

    def _drop(self, group_id: str, reason: str) -> None:
        record = self.ledger.get(group_id)
        if record.state not in (GroupState.TRAINED, GroupState.DROPPED):
            self.ledger.advance(group_id, GroupState.DROPPED, reason)

    # ---- training and weight sync ----------------------------------------------------------------

    async def _collect_batch(self) -> tuple[list[types_pb2.ScoredGroup], list[int]]:
        """B groups within the staleness bound; late ones are dropped and their prompts re-issued."""
        groups, staleness = [], []
        while len(groups) < self.settings.groups_per_batch:
            group = await self.scored.get()
            age = group_staleness(group.completions, self.version)
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
            result = (
                await self.learner.TrainStep(
                    learner_pb2.TrainStepRequest(batch=batch), timeout=cfg.timeouts.train_step
                )
            ).result
            train_ms = (time.perf_counter() - step_started) * 1e3
            for group in groups:
                self.ledger.advance(group.group_id, GroupState.TRAINED)
            await self.pool.notify()
            self.staleness_seen.extend(staleness)
            async with self.syncer.lock:
                self.version, self.step = result.weight_version, result.step
                sync = await self.syncer.sync([h for h in self.pool.healthy()])
                self.last_alignment = await self._check_alignment(
                    [h for h in self.pool.healthy() if h.version == self.version]
                )
            await self.pool.notify()
            record = self._step_record(groups, staleness, result, sync, train_ms)
            if cfg.eval_every and self.step % cfg.eval_every == 0:
                record.update(await self.evaluator.run(self.version))
            self._metrics.write(record)
            log.info(
                "step",
                step=self.step,
                reward=round(record["reward_mean"], 4),
                loss=round(record["loss"], 5),
                sync_ms=round(sync.total_ms, 1),
                diff=record["logprob_abs_diff_max"],
            )

    def _step_record(self, groups, staleness, result, sync, train_ms) -> dict:
        rewards = [r for g in groups for r in g.rewards]
        metrics = dict(result.metrics)
        return {
            "step": result.step,
            "weight_version": result.weight_version,
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "loss": metrics.get("loss", float("nan")),
            "staleness_mean": statistics.fmean(staleness),
            "staleness_max": max(staleness),
            "sync_ms": sync.total_ms,
            "sync_prepare_ms": sync.prepare_ms,
            "sync_stage_ms": sync.stage_ms,
            "sync_commit_ms": sync.commit_ms,
            "weight_transport": self.settings.weight_transport,
            "logprob_abs_diff_max": self.last_alignment,
            "tokens_per_s": self.tokens.take(),
            "train_ms": train_ms,
            "groups_dropped": self.ledger.counts()["dropped"],
            "behaviour_versions": sorted(
                {sp.version for g in groups for c in g.completions for sp in c.version_spans}
            ),
            "rollouts_synced": len(sync.synced),
            **{f"learner/{k}": v for k, v in metrics.items()},
        }

    async def _log_eval_only(self) -> None:
        record = {"step": self.step, "weight_version": self.version, "eval_only": True}
        record.update(await self.evaluator.run(self.version))
        self._metrics.write(record)

    async def _monitor_health(self) -> None:
        """Poll rollouts; bring healthy ones that lag (restarted or newly registered) up to date."""
        while True:
            await asyncio.sleep(self.settings.health_interval_seconds)
            await self.pool.refresh_all()
            lagging = [h for h in self.pool.healthy() if h.version < self.version and not h.syncing]
            if lagging and not self.syncer.lock.locked():
                async with self.syncer.lock:
                    log.info(
                        "catching up rollouts", rollouts=[h.rollout_id for h in lagging], version=self.version
                    )
                    try:
                        await self.syncer.sync(lagging)
                    except grpc.aio.AioRpcError as exc:
                        log.warning("catch-up sync failed", code=exc.code().name, detail=exc.details())

    # ---- status ------------------------------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return not self.resumed.is_set()

    def pause(self, paused: bool) -> None:
        """Stop (or restart) issuing new groups; in-flight groups still finish and train."""
        if paused:
            self.resumed.clear()
        else:
            self.resumed.set()
