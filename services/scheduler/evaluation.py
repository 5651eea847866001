"""Periodic evaluation on the environment's held-out split.

Samples the first `eval_prompts` eval prompts (always the same ones: `start=0`), generates
`eval_samples` completions each on the rollouts, and lets the environment aggregate them
(accuracy, mean reward, pass@k). Results go into that step's metrics under `eval/…`.
"""

from __future__ import annotations

import asyncio

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2, env_pb2_grpc
from grpo.rollout.v1 import rollout_pb2
from services.scheduler.config import SchedulerSettings
from services.scheduler.rollouts import RolloutPool


class Evaluator:
    def __init__(
        self, settings: SchedulerSettings, env: env_pb2_grpc.EnvironmentServiceStub, pool: RolloutPool
    ) -> None:
        self._settings = settings
        self._env = env
        self._pool = pool

    async def run(self, version: int) -> dict[str, float]:
        cfg = self._settings
        prompts = (
            await self._env.SamplePrompts(
                env_pb2.SamplePromptsRequest(n=cfg.eval_prompts, split=env_pb2.SPLIT_EVAL, start=0),
                timeout=cfg.timeouts.control,
            )
        ).prompts
        sampling = types_pb2.SamplingParams(
            n=cfg.eval_samples,
            temperature=cfg.eval_temperature,
            top_p=1.0,
            max_tokens=cfg.sampling.max_tokens,
        )
        groups = await asyncio.gather(
            *(self._generate(i, p, sampling, version) for i, p in enumerate(prompts))
        )
        response = await self._env.Evaluate(
            env_pb2.EvaluateRequest(groups=groups), timeout=cfg.timeouts.score
        )
        return dict(response.metrics)

    async def _generate(
        self, index: int, prompt: types_pb2.Prompt, sampling: types_pb2.SamplingParams, version: int
    ) -> env_pb2.ScoreCompletionsRequest:
        handle = await self._pool.acquire(lambda: version, 0)
        try:
            request = rollout_pb2.GenerateRequest(
                request_id=f"eval-v{version}-{index}", prompt=prompt, sampling_params=sampling
            )
            completions = [
                r.completion
                async for r in handle.stub.Generate(request, timeout=self._settings.timeouts.generate)
            ]
        finally:
            await self._pool.release(handle)
        return env_pb2.ScoreCompletionsRequest(prompt=prompt, completions=completions)
