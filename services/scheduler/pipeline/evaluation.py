"""Periodic evaluation on the environment's held-out split.

Samples the first `eval_prompts` eval prompts (always the same ones: `start=0`), generates
`eval_samples` completions each on the rollouts, and lets the environment aggregate them
(accuracy, mean reward, pass@k). Results go into that step's metrics under `eval/…`. An eval split
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
from services.scheduler.peers.rollouts import RolloutPool, abandonable

log = get_logger(__name__)


class Evaluator:
    def __init__(self, settings: SchedulerSettings, env: EnvClient, pool: RolloutPool) -> None:
        self._settings = settings
        self._env = env
        self._pool = pool
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
        groups = await asyncio.gather(
            *(self._generate(i, p, sampling, version) for i, p in enumerate(prompts))
        )
        metrics = await patiently(cfg.recovery, "env", partial(self._env.evaluate, groups))
        metrics["eval/prompts_requested"] = float(cfg.eval_prompts)
        return metrics

    async def _generate(
        self, index: int, prompt: types_pb2.Prompt, sampling: Sampling, version: int
    ) -> tuple[types_pb2.Prompt, list[types_pb2.Completion]]:
        handle = await self._pool.acquire(lambda: version, 0)
        try:
            call = handle.client.generate(f"eval-v{version}-{index}", prompt, sampling)
            return prompt, await abandonable(handle, call)
        finally:
            await self._pool.release(handle)
