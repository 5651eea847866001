"""EnvHost: hosts one Environment plug-in: prompt cursors, scoring pool, failure policy, counters.

The environment itself is stateless (base.py). The host loads it from the settings' recipe, runs its
`setup()` here (the prompt source lives in this process), keeps its `PromptCursor` (positions, epoch
order, eval bounds; cursor.py) and a `ScoringPool` of worker processes that rebuild the scorer from
the same recipe. It validates requests (InvalidArgument with a precise message), applies the failure
policy to scored groups and keeps the counters reported as metrics. No protos here (servicer.py).

Failure policy: every failed completion is reported with `failure_reward`; under "skip_group" a
group with any failure is additionally flagged `skip_group=True` (the scheduler must not train on
it), under "assign_value" it is used as is.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.common.errors import InvalidArgument, Unavailable
from services.common.logging import get_logger
from services.env.base import GroupResult, Message, PromptItem, Reply, Score, SplitName, failure
from services.env.chat import apply_format
from services.env.config import EnvSettings
from services.env.cursor import Draw, PromptCursor, interleaved
from services.env.episodes import tools_json
from services.env.evaluation import eval_metrics
from services.env.loader import EnvLoadError, LoadedEnv, load_recipe
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
    """One group to score: the prompt as served and the completion texts; for episodes also their
    transcripts (scored through `score_episodes`) and each one's failure ("" = it ended normally)."""

    prompt: PromptItem
    completions: list[str]
    completion_prompt_ids: list[str]
    transcripts: list[list[Message]] | None = None
    failures: list[str] = field(default_factory=list)


@dataclass
class _Hosted:
    """What `start()` built: the env and its scorer, the env's cursor, the scoring pool."""

    loaded: LoadedEnv
    cursor: PromptCursor
    pool: ScoringPool
    tools_json: str = ""


class EnvHost:
    """Environment + cursor + scoring pool + policy + metrics. Create, `await start()`, use, `stop()`."""

    def __init__(self, settings: EnvSettings) -> None:
        self.settings = settings
        self.recipe = settings.recipe()
        self.counters: Counter[str] = Counter()
        self._hosted: _Hosted | None = None

    async def start(self) -> None:
        """Load the environment (raises EnvLoadError with a clear message) and start the scoring workers."""
        loaded = await asyncio.to_thread(load_recipe, self.recipe)
        await loaded.env.setup()
        s = self.settings
        pool = ScoringPool(
            self.recipe,
            workers=s.score_workers,
            max_workers=s.max_score_workers,
            spare_after=s.spare_worker_after_seconds,
            timeout=s.score_timeout_seconds,
            startup_timeout=s.worker_startup_timeout_seconds,
            max_pending=s.max_pending_scores,
            reward_range=(s.reward_min, s.reward_max),
        )
        try:
            tools = await asyncio.to_thread(tools_json, loaded.env)  # checks every tool's schema
        except Exception as exc:
            await pool.close()
            raise EnvLoadError(f"environment {loaded.env.name!r} has a bad tool: {exc}") from exc
        await pool.start()
        self._hosted = _Hosted(loaded, PromptCursor(loaded.env), pool, tools)
        log.info(
            "environment ready", env=loaded.env.name, options=loaded.options_dict(), workers=s.score_workers
        )

    async def stop(self) -> None:
        if self._hosted is not None:
            await self._hosted.pool.close()

    def _ready(self) -> _Hosted:
        if self._hosted is None:
            raise Unavailable("environment is still loading; retry shortly")
        return self._hosted

    @property
    def name(self) -> str:
        return self._ready().loaded.env.name

    # ------------------------------------------------------------------ describe / state
    def describe(self) -> dict[str, Any]:
        hosted = self._ready()
        env, scorer = hosted.loaded.env, hosted.loaded.scorer
        return {
            "name": env.name,
            "description": env.description,
            "options": hosted.loaded.options_dict(),
            "train_size": env.split_size("train"),
            "eval_size": env.split_size("eval"),
            "failure_policy": self.settings.failure_policy,
            "failure_reward": self.settings.failure_reward,
            "score_timeout_seconds": self.settings.score_timeout_seconds,
            "reward_range": hosted.pool.reward_range,
            "success_threshold": scorer.success_threshold,
            "max_turns": env.turn_limit,
            "tools_json": hosted.tools_json,
            "respond_timeout_seconds": env.respond_timeout,
            "episode_timeout_seconds": env.episode_timeout,
            "max_episode_tokens": env.max_episode_tokens,
            "levels": list(hosted.cursor.levels),
        }

    @property
    def tools_json(self) -> str:
        """The environment's tools as Prompt.tools_json ("" when it has none)."""
        return self._ready().tools_json

    @property
    def ready(self) -> bool:
        return self._hosted is not None

    def workers(self) -> int:
        """Scoring worker processes running now (spares included)."""
        return self._ready().pool.running

    def metrics(self) -> dict[str, float]:
        """Cumulative counters under "env/" (host counters plus the pool's)."""
        pool = self._ready().pool
        merged = Counter(self.counters)
        merged.update(pool.counters)
        merged["failures"] = sum(v for k, v in pool.counters.items() if k.startswith("failures."))
        return {f"env/{key}": float(value) for key, value in sorted(merged.items())}

    def positions(self) -> dict[SplitName, int]:
        """Each split's cursor (GetEnvironmentState); `sample(start=...)` restores one."""
        return self._ready().cursor.positions()

    def level_positions(self) -> dict[str, int]:
        """Each level stream's cursor (levels drawn from by name so far)."""
        return self._ready().cursor.level_positions()

    # ------------------------------------------------------------------ prompts
    async def sample(
        self, n: int, split: SplitName, start: int | None = None, level: str | None = None
    ) -> Draw:
        """Prompts of `split` (or of `level`'s own train stream; cursor.py) in the configured prompt
        format, from `start`, default the split's (level's) cursor.

        Train serves `n` prompts, cycling epochs of finite data; eval serves each remaining prompt once
        (min(n, eval size - start)) and never wraps around.
        """
        hosted = self._ready()
        if not 1 <= n <= self.settings.max_prompts_per_call:
            raise InvalidArgument(f"n must be in [1, {self.settings.max_prompts_per_call}], got {n}")
        draw = await hosted.cursor.take(n, split, start, level)
        if len(draw.prompts) < n:
            log.warning(
                "more eval prompts asked for than the eval split holds; each is served once",
                asked=n,
                served=len(draw.prompts),
                start=draw.start,
                eval_size=hosted.loaded.env.split_size(split),
            )
        env, levels = hosted.loaded.env, hosted.cursor.levels
        finite = env.split_size(split) > 0
        served = []
        for offset, item in enumerate(draw.prompts):
            item = apply_format(item, self.settings.prompt_format)
            position = draw.start + offset
            if levels and split == "train":  # the train-split position: unique over all the levels
                finite = env.level_size(item.metadata["level"]) > 0
                position = position if level is None else interleaved(levels, level, position)
            if split == "train" and finite:  # finite data repeats across epochs: keep ids unique per run
                item = replace(item, id=f"{item.id}@{position}")
            served.append(item)
        self.counters[f"prompts_sampled.{split}"] += len(served)
        return replace(draw, prompts=served)

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
        if job.transcripts is not None and len(job.transcripts) != len(job.completions):
            raise InvalidArgument(
                f"{len(job.transcripts)} transcripts for {len(job.completions)} completions"
            )
        for index, prompt_id in enumerate(job.completion_prompt_ids):
            if prompt_id and prompt.id and prompt_id != prompt.id:
                raise InvalidArgument(
                    f"completion {index} belongs to prompt {prompt_id!r}, not {prompt.id!r}"
                )

    def env_name_matches(self, name: str) -> bool:
        return not name or name == self.name

    def _apply_policy(self, scores: list[Score]) -> ScoredGroupOutcome:
        rewards = [
            float(s.reward) if s.reward is not None and not s.failure else self.settings.failure_reward
            for s in scores
        ]
        failed = sum(1 for s in scores if s.failure or s.reward is None)
        skip = failed > 0 and self.settings.failure_policy == "skip_group"
        self.counters["groups_scored"] += 1
        if failed:
            self.counters["groups_with_failures"] += 1
        if skip:
            self.counters["groups_skipped"] += 1
        return ScoredGroupOutcome(scores=scores, rewards=rewards, skip_group=skip, failed_count=failed)

    async def score(self, job: ScoreJob) -> ScoredGroupOutcome:
        """Score one group in the pool; scorer faults are failures inside the outcome, never exceptions.
        An episode that failed before it ended is not scored: it is a failure of kind "episode"."""
        pool = self._ready().pool
        self.validate_job(job)
        failed = {i: reason for i, reason in enumerate(job.failures) if reason}
        if not failed:
            return self._apply_policy(await pool.score(job.prompt, job.completions, job.transcripts))
        keep = [i for i in range(len(job.completions)) if i not in failed]
        texts = [job.completions[i] for i in keep]
        transcripts = None if job.transcripts is None else [job.transcripts[i] for i in keep]
        scored = iter(await pool.score(job.prompt, texts, transcripts) if keep else [])
        self.counters["episodes_failed"] += len(failed)
        scores = [
            failure("episode", failed[i]) if i in failed else next(scored)
            for i in range(len(job.completions))
        ]
        return self._apply_policy(scores)

    # ------------------------------------------------------------------ multi-turn
    async def respond(self, prompt: PromptItem, transcripts: list[list[Message]]) -> list[Reply | str]:
        """The environment's turn in each live episode of a group (a failure text where it could not
        answer); tools run in the workers."""
        hosted = self._ready()
        if not transcripts:
            raise InvalidArgument("no transcripts to respond to")
        limit = self.settings.max_completions_per_call
        if len(transcripts) > limit:
            raise InvalidArgument(f"{len(transcripts)} transcripts in one call; the limit is {limit}")
        for index, transcript in enumerate(transcripts):
            if not transcript or transcript[-1].get("role") != "assistant":
                raise InvalidArgument(f"transcripts[{index}] must end with the model's (assistant) message")
        replies = await hosted.pool.respond(prompt, transcripts, hosted.loaded.env.respond_timeout)
        for reply in replies:
            if isinstance(reply, Reply):
                self.counters["tool_calls"] += reply.tool_calls
                self.counters["tool_errors"] += reply.tool_errors
        return replies

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
        loaded = self._ready().loaded
        if not jobs:
            raise InvalidArgument("evaluation needs at least one group")
        outcomes: list[ScoredGroupOutcome | None] = [None] * len(jobs)
        async for index, outcome in self.score_many(jobs):
            outcomes[index] = outcome
        done = [o for o in outcomes if o is not None]
        results = [GroupResult(j.prompt, j.completions, o.scores) for j, o in zip(jobs, done, strict=True)]
        metrics = eval_metrics(results, loaded.scorer.success_threshold)
        try:
            extra = await asyncio.to_thread(loaded.env.evaluate, results)
            metrics.update({key: float(value) for key, value in extra.items()})
        except Exception as exc:  # a broken hook must not lose the standard metrics
            log.warning("environment evaluate hook failed", error=f"{type(exc).__name__}: {exc}")
            metrics["evaluate_hook_errors"] = 1.0
        self.counters["evaluations"] += 1
        return {f"eval/{key}": value for key, value in metrics.items()}, done
