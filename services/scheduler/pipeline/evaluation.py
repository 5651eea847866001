"""Periodic evaluation on the environment's held-out split.

Samples the first `eval_prompts` eval prompts (always the same ones: `start=0`), generates
`eval_samples` completions each on the rollouts, and lets the environment aggregate them
(accuracy, mean reward, pass@k). A multi-turn task's held-out episodes run exactly as training's
(`episodes.py`), and `eval/tool_call_rate` / `eval/turns_mean` say how they went. Results go into
that step's metrics under `eval/…`. An eval split
smaller than `eval_prompts` is evaluated once per prompt (the env never repeats eval prompts): a
warning says so and `eval/num_prompts` carries the real count.
"""

from __future__ import annotations

import asyncio
from functools import partial

from grpo.common.v1 import types_pb2
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.peers.clients import EnvClient, Sampling
from services.scheduler.peers.patience import patiently
from services.scheduler.peers.placement import credits_taken
from services.scheduler.peers.rollouts import RolloutPool, abandonable
from services.scheduler.pipeline.episodes import EpisodeRunner, transcripts_of

log = get_logger(__name__)


class Evaluator:
    def __init__(
        self,
        settings: SchedulerSettings,
        env: EnvClient,
        pool: RolloutPool,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self._settings = settings
        self._env = env
        self._pool = pool
        self._episodes = episodes or EpisodeRunner(settings, env)
        self._warned = False

    async def run(self, version: int) -> dict[str, float]:
        cfg = self._settings
        prompts = await patiently(
            cfg.recovery, "env", partial(self._env.sample, cfg.eval_prompts, "eval", start=0)
        )
        if len(prompts) < cfg.eval_prompts and not self._warned:
            self._warned = True
            log.warning(
                "eval split is smaller than eval_prompts: each prompt is evaluated once",
                eval_prompts=cfg.eval_prompts,
                served=len(prompts),
            )
        sampling = Sampling(
            n=cfg.eval_samples, temperature=cfg.eval_temperature, max_tokens=cfg.sampling.max_tokens
        )
        played = await asyncio.gather(
            *(self._generate(i, p, sampling, version) for i, p in enumerate(prompts))
        )
        groups = [(prompt, transcripts) for prompt, transcripts, _ in played]
        metrics = await patiently(cfg.recovery, "env", partial(self._env.evaluate, groups))
        metrics["eval/prompts_requested"] = float(cfg.eval_prompts)
        if self._episodes.multi_turn:
            stats = [s for _, _, s in played]
            episodes = max(1.0, sum(s["episodes"] for s in stats))
            metrics["eval/tool_call_rate"] = sum(s["episodes_with_tool_calls"] for s in stats) / episodes
            metrics["eval/valid_tool_call_rate"] = (
                sum(s["episodes_with_valid_calls"] for s in stats) / episodes
            )
            metrics["eval/turns_mean"] = sum(s["model_turns"] for s in stats) / episodes
            metrics["eval/episode_failures"] = sum(s["failures"] for s in stats)
        return metrics

    async def _generate(
        self, index: int, prompt: types_pb2.Prompt, sampling: Sampling, version: int
    ) -> tuple[types_pb2.Prompt, list[types_pb2.Transcript], dict[str, float]]:
        cost = sampling.n if self._episodes.multi_turn else 1
        handle = await self._pool.acquire(lambda: version, 0, cost)
        try:
            request_id = f"eval-v{version}-{index}"
            completions = sorted(
                await abandonable(handle, handle.client.generate(request_id, prompt, sampling)),
                key=lambda c: c.index,
            )
            if not self._episodes.multi_turn:
                return prompt, transcripts_of(completions), {}
            _, transcripts, _, stats = await self._episodes.run(
                request_id, prompt, completions, handle, sampling
            )
            return prompt, transcripts, stats
        finally:
            await self._pool.release(handle, credits_taken(handle, cost))
