"""EnvService: the environment service's domain logic, free of protos.

It owns the loaded `Environment` (the prompt source, in this process) and the `ScoringPool` (the
scorer, in worker processes). It validates requests (InvalidArgument with a precise message),
applies the failure policy to scored groups and keeps the counters reported as metrics.

Failure policy: every failed completion is reported with `failure_reward`; under "skip_group" a
group with any failure is additionally flagged `skip_group=True` (the scheduler must not train on
it), under "assign_value" it is used as is.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.logging import get_logger
from services.env.base import Environment, GroupResult, PromptItem, Score, SplitName
from services.env.chat import apply_format
from services.env.config import EnvSettings
from services.env.evaluation import eval_metrics
from services.env.loader import load_environment
from services.env.scoring import ScoringPool

log = get_logger(__name__)


@dataclass
class ScoredGroupOutcome:
    """What ScoreCompletions returns for one group after the failure policy."""

    scores: list[Score]
    rewards: list[float]
    skip_group: bool
    failed_count: int


@dataclass
class ScoreJob:
    """One group to score: the prompt as served and the completion texts."""

    prompt: PromptItem
    completions: list[str]
    completion_prompt_ids: list[str]


class EnvService:
    """Environment + scoring pool + policy + metrics. Create, `await start()`, use, `await stop()`."""

    def __init__(self, settings: EnvSettings) -> None:
        self.settings = settings
        self.recipe = settings.recipe()
        self.env: Environment | None = None
        self.pool: ScoringPool | None = None
        self.counters: Counter[str] = Counter()

    async def start(self) -> None:
        """Load the environment (raises EnvLoadError with a clear message) and start the scoring workers."""
        env = await asyncio.to_thread(load_environment, self.recipe)
        await env.setup()
        s = self.settings
        pool = ScoringPool(
            self.recipe,
            workers=s.score_workers,
            timeout=s.score_timeout_seconds,
            startup_timeout=s.worker_startup_timeout_seconds,
            max_pending=s.max_pending_scores,
            reward_range=(s.reward_min, s.reward_max),
        )
        await pool.start()
        self.env, self.pool = env, pool
        log.info("environment ready", env=env.name, options=env.options_dict(), workers=s.score_workers)

    async def stop(self) -> None:
        if self.pool is not None:
            await self.pool.close()

    def _ready(self) -> tuple[Environment, ScoringPool]:
        if self.env is None or self.pool is None:
            raise FailedPrecondition("environment is not loaded yet")
        return self.env, self.pool

    @property
    def name(self) -> str:
        env, _ = self._ready()
        return env.name

    # ------------------------------------------------------------------ describe / state
    def describe(self) -> dict[str, Any]:
        env, pool = self._ready()
        return {
            "name": env.name,
            "description": env.description,
            "options": env.options_dict(),
            "train_size": env.split_size("train"),
            "eval_size": env.split_size("eval"),
            "failure_policy": self.settings.failure_policy,
            "failure_reward": self.settings.failure_reward,
            "score_timeout_seconds": self.settings.score_timeout_seconds,
            "reward_range": pool.reward_range,
            "success_threshold": env.success_threshold,
        }

    def metrics(self) -> dict[str, float]:
        """Cumulative counters under "env/" (service counters plus the pool's)."""
        _, pool = self._ready()
        merged = Counter(self.counters)
        merged.update(pool.counters)
        merged["failures"] = sum(v for k, v in pool.counters.items() if k.startswith("failures."))
        return {f"env/{key}": float(value) for key, value in sorted(merged.items())}

    def positions(self) -> dict[str, int]:
        env, _ = self._ready()
        return {"train": env.position("train"), "eval": env.position("eval")}

    # ------------------------------------------------------------------ prompts
    async def sample(
        self, n: int, split: SplitName, start: int | None = None
    ) -> tuple[list[PromptItem], int]:
        """`n` prompts of `split` (served in the configured prompt format) and the cursor after them."""
        env, _ = self._ready()
        if not 1 <= n <= self.settings.max_prompts_per_call:
            raise InvalidArgument(f"n must be in [1, {self.settings.max_prompts_per_call}], got {n}")
        size = env.split_size(split)
        if split == "eval" and size == 0:
            raise FailedPrecondition(f"environment {env.name!r} has no eval split (eval_size = 0)")
        first = env.position(split) if start is None else start
        items = await env.sample(n, split, start)
        if len(items) != n:
            raise FailedPrecondition(f"environment {env.name!r} returned {len(items)} prompts for n={n}")
        served = []
        for offset, item in enumerate(items):
            item = apply_format(item, self.settings.prompt_format)
            if split == "train" and size > 0:  # finite data repeats across epochs: keep ids unique per run
                item = _with_id(item, f"{item.id}@{first + offset}")
            served.append(item)
        self.counters[f"prompts_sampled.{split}"] += n
        return served, env.position(split)

    # ------------------------------------------------------------------ scoring
    def validate_job(self, job: ScoreJob) -> None:
        """Reject malformed requests before any scoring happens."""
        prompt = job.prompt
        if not prompt.text and not prompt.messages:
            raise InvalidArgument("prompt has neither text nor messages")
        if prompt.text and prompt.messages:
            raise InvalidArgument(f"prompt {prompt.id!r} has both text and messages; exactly one must be set")
        if not job.completions:
            raise InvalidArgument(f"no completions to score for prompt {prompt.id!r}")
        limit = self.settings.max_completions_per_call
        if len(job.completions) > limit:
            raise InvalidArgument(f"{len(job.completions)} completions in one call; the limit is {limit}")
        for index, prompt_id in enumerate(job.completion_prompt_ids):
            if prompt_id and prompt.id and prompt_id != prompt.id:
                raise InvalidArgument(
                    f"completion {index} belongs to prompt {prompt_id!r}, not {prompt.id!r}"
                )

    def env_name_matches(self, name: str) -> bool:
        env, _ = self._ready()
        return not name or name == env.name

    def _apply_policy(self, scores: list[Score]) -> ScoredGroupOutcome:
        failed = sum(1 for s in scores if s.failure or s.reward is None)
        rewards = [
            self.settings.failure_reward if (s.failure or s.reward is None) else float(s.reward)  # type: ignore[arg-type]
            for s in scores
        ]
        skip = failed > 0 and self.settings.failure_policy == "skip_group"
        self.counters["groups_scored"] += 1
        if failed:
            self.counters["groups_with_failures"] += 1
        if skip:
            self.counters["groups_skipped"] += 1
        return ScoredGroupOutcome(scores=scores, rewards=rewards, skip_group=skip, failed_count=failed)

    async def score(self, job: ScoreJob) -> ScoredGroupOutcome:
        """Score one group in the pool; scorer faults are failures inside the outcome, never exceptions."""
        _, pool = self._ready()
        self.validate_job(job)
        return self._apply_policy(await pool.score(job.prompt, job.completions))

    async def score_many(self, jobs: Sequence[ScoreJob]) -> AsyncIterator[tuple[int, ScoredGroupOutcome]]:
        """Score many groups, yielding (index, outcome) as each finishes; at most 2×workers in flight."""
        for job in jobs:
            self.validate_job(job)
        limit = asyncio.Semaphore(2 * self.settings.score_workers)

        async def one(index: int, job: ScoreJob) -> tuple[int, ScoredGroupOutcome]:
            async with limit:
                return index, await self.score(job)

        tasks = [asyncio.ensure_future(one(i, job)) for i, job in enumerate(jobs)]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()

    # ------------------------------------------------------------------ evaluation
    async def evaluate(self, jobs: Sequence[ScoreJob]) -> tuple[dict[str, float], list[ScoredGroupOutcome]]:
        """Score eval groups and aggregate metrics (keys prefixed "eval/")."""
        env, _ = self._ready()
        if not jobs:
            raise InvalidArgument("evaluation needs at least one group")
        outcomes: list[ScoredGroupOutcome | None] = [None] * len(jobs)
        async for index, outcome in self.score_many(jobs):
            outcomes[index] = outcome
        done = [o for o in outcomes if o is not None]
        results = [GroupResult(j.prompt, j.completions, o.scores) for j, o in zip(jobs, done, strict=True)]
        metrics = eval_metrics(results, env.success_threshold)
        try:
            extra = await asyncio.to_thread(env.evaluate, results)
            metrics.update({key: float(value) for key, value in extra.items()})
        except Exception as exc:  # a broken hook must not lose the standard metrics
            log.warning("environment evaluate hook failed", error=f"{type(exc).__name__}: {exc}")
            metrics["evaluate_hook_errors"] = 1.0
        self.counters["evaluations"] += 1
        return {f"eval/{key}": value for key, value in metrics.items()}, done


def _with_id(item: PromptItem, prompt_id: str) -> PromptItem:
    from dataclasses import replace

    return replace(item, id=prompt_id)
