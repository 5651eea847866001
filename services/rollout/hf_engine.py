"""Rollout engine on plain transformers, for machines without vLLM (and fast unit tests).

Requests queue up (bounded) and a batcher runs them, up to `max_batch_size` samples at a time, in ONE
executor thread: prefill of the left-padded prompts, then token-by-token decoding with a KV cache, in
slices of at most `slice_ms`. Between slices the thread is free for what else queued on it (a weight
load, a `ScoreTokens`), finished samples go back at once, and the batch is rebuilt when it must: new
samples join while there is room, and after a weight load the unfinished rows are re-prefilled under
the new weights (vLLM's `keep` pause mode) with a new version span from there on. Without slices a
sync waited for a whole batch (measured on an H200, Qwen2.5-0.5B's shape, 128 tokens: ~2 s for the
commit and ~2 s more for the probe, each step). Per-token logprobs are "processed": log_softmax of
logits / T after top-k / top-p truncation, matching vLLM's processed_logprobs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.common.logging import get_logger
from services.common.weights import LoraSpec, Manifest, dtype_from_name
from services.rollout import adapters
from services.rollout.config import RolloutSettings
from services.rollout.engine import (
    FINISH_LENGTH,
    FINISH_STOP,
    FinishedCompletion,
    LoadTimings,
    RolloutEngine,
    Sampling,
    VersionSpan,
)
from services.transports import LoadPlan, WorkerContext
from services.transports.registry import LocalWorkers, open_tensors

log = get_logger(__name__)


@dataclass
class _Row:
    """One sample of one request inside a batch."""

    prompt: list[int]
    sampling: Sampling
    index: int
    out: asyncio.Queue
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (version, first token index)
    finish: str = ""
    text: str = ""
    delivered: bool = False

    def version_spans(self) -> tuple[VersionSpan, ...]:
        ends = [start for _, start in self.spans[1:]] + [len(self.tokens)]
        return tuple(VersionSpan(v, start, end) for (v, start), end in zip(self.spans, ends, strict=True))


@dataclass
class _Batch:
    """Rows decoding together, their KV cache and next-token logits (touched only by the engine thread)."""

    rows: list[_Row]
    version: int  # the weights the cache was computed with
    cache: Any
    mask: torch.Tensor  # [B, L] 1 = a real token
    positions: torch.Tensor  # [B, 1] position of the last token
    logits: torch.Tensor  # [B, V] float32, for the next token of every row
    temperature: torch.Tensor  # [B]


def processed_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """log_softmax(logits / T) after per-row top-k / top-p truncation (renormalised).

    logits [B, V] float32, temperature [B]; top_k 0 and top_p 1.0 mean off. Returns [B, V] with -inf
    outside the kept set.
    """
    scaled = logits / temperature[:, None]  # [B, V]
    for row, k in enumerate(top_k):
        if 0 < k < scaled.shape[-1]:
            kth = torch.topk(scaled[row], k).values[-1]
            scaled[row] = scaled[row].masked_fill(scaled[row] < kth, float("-inf"))
    for row, p in enumerate(top_p):
        if p < 1.0:
            sorted_logits, order = torch.sort(scaled[row], descending=True)  # [V]
            cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)  # [V]
            drop_sorted = cumulative - torch.softmax(sorted_logits, -1) >= p  # keep until mass p reached
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            scaled[row] = scaled[row].masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


class HfEngine(RolloutEngine):
    """`RolloutEngine` on a transformers causal LM."""

    name = "transformers"
    adapters_refused = ""  # adapter versions are served with peft (adapters.py)

    def __init__(self, settings: RolloutSettings) -> None:
        self._settings = settings
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        # samples waiting for a batch: every request in flight may queue its n samples (n ≤ 8 typical)
        self._queue: asyncio.Queue[_Row] = asyncio.Queue(maxsize=max(1024, settings.max_in_flight * 8))
        self._model: Any = None
        self._tokenizer: Any = None
        self._eos: set[int] = set()
        self._version = 0
        self._borrowed = False  # parameters are views of the learner's buffer (zero-copy cuda_ipc)
        self._adapter: LoraSpec | None = None  # the LoRA adapter served over the base (adapters.py)
        self._max_model_len = settings.max_model_len
        self._generator: torch.Generator | None = None  # unseeded samples; on the model's device
        self._worker: WorkerContext | None = None  # this process, as weight transports see it
        self._batcher: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    def _load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        settings, hf = self._settings, self._settings.hf
        if hf.num_threads > 0:
            torch.set_num_threads(hf.num_threads)
        device = hf.device if hf.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        if settings.dtype == "auto":
            dtype = torch.bfloat16 if device == "cuda" else torch.float32
        else:
            dtype = dtype_from_name(settings.dtype)
        model = AutoModelForCausalLM.from_pretrained(
            settings.model, dtype=dtype, trust_remote_code=settings.trust_remote_code
        )
        self._model = model.to(device).eval()
        limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        if settings.max_model_len and limit and settings.max_model_len > limit:
            raise FailedPrecondition(
                f"max_model_len {settings.max_model_len} exceeds the model's {limit} positions"
            )
        self._max_model_len = settings.max_model_len or limit
        self._worker = WorkerContext(state={}, local_rank=0, device=torch.device(device))
        # torch.multinomial needs a generator of its input's device
        self._generator = torch.Generator(device=device).manual_seed(settings.seed)
        self._tokenizer = AutoTokenizer.from_pretrained(
            settings.tokenizer or settings.model, trust_remote_code=settings.trust_remote_code
        )
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else self._tokenizer.eos_token_id
        self._eos = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())

    async def start(self) -> None:
        started = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self._executor, self._load)
        self._batcher = asyncio.create_task(self._run_batches(), name="hf-batcher")
        log.info(
            "transformers engine started",
            model=self._settings.model,
            max_model_len=self._max_model_len,
            start_s=round(time.perf_counter() - started, 2),
        )

    async def stop(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            await asyncio.gather(self._batcher, return_exceptions=True)
            self._batcher = None
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ generation
    async def generate(
        self, prompt_token_ids: list[int], sampling: Sampling, request_id: str
    ) -> AsyncIterator[list[FinishedCompletion]]:
        out: asyncio.Queue = asyncio.Queue(maxsize=sampling.n)
        if self._queue.qsize() + sampling.n > self._queue.maxsize:
            raise ResourceExhausted(f"transformers engine queue is full ({self._queue.maxsize} samples)")
        rows = []
        for index in range(sampling.n):
            generator = None
            if sampling.seed:
                generator = torch.Generator(device=self._worker.device).manual_seed(sampling.seed + index)
            rows.append(_Row(list(prompt_token_ids), sampling, index, out, generator))
        for row in rows:
            self._queue.put_nowait(row)
        try:
            remaining = sampling.n
            while remaining:
                ready = [await out.get()]  # then whatever the same batch finished
                while not out.empty():
                    ready.append(out.get_nowait())
                for item in ready:
                    if isinstance(item, BaseException):
                        raise item
                remaining -= len(ready)
                yield ready
        finally:
            for row in rows:
                row.finish = row.finish or "cancelled"  # queued rows of an abandoned request are skipped

    async def _run_batches(self) -> None:
        """Form batches, decode them slice by slice, deliver finished samples, rebuild when needed."""
        loop = asyncio.get_running_loop()
        slice_s = self._settings.hf.slice_ms / 1e3
        while True:
            rows = self._take([await self._queue.get()])
            batch: _Batch | None = None
            try:
                while rows:
                    batch = await loop.run_in_executor(self._executor, self._prefill, rows)
                    while True:
                        stale = await loop.run_in_executor(self._executor, self._decode, batch, slice_s)
                        self._deliver(batch.rows)
                        rows = [row for row in batch.rows if not row.finish]
                        room = self._settings.hf.max_batch_size - len(rows)
                        joining = self._take([], room)
                        if joining or (rows and stale):
                            rows += joining  # rebuilt: new rows join, or the weights changed
                            break
                        if not rows:
                            break
            except Exception as exc:
                log.exception("transformers batch failed")
                for row in [*rows, *(batch.rows if batch is not None else [])]:
                    if not row.delivered:
                        row.delivered = True
                        row.out.put_nowait(exc)

    def _take(self, rows: list[_Row], limit: int | None = None) -> list[_Row]:
        """`rows` plus queued samples up to `limit` (`max_batch_size`), less those already abandoned."""
        limit = self._settings.hf.max_batch_size if limit is None else limit
        while len(rows) < limit and not self._queue.empty():
            rows.append(self._queue.get_nowait())
        return [row for row in rows if not row.finish]

    def _deliver(self, rows: list[_Row]) -> None:
        """Hand each newly finished row to its request (rows of abandoned requests are dropped)."""
        for row in rows:
            if not row.finish or row.delivered:
                continue
            row.delivered = True
            if row.finish == "cancelled":
                continue
            row.out.put_nowait(
                FinishedCompletion(
                    index=row.index,
                    token_ids=tuple(row.tokens),
                    logprobs=tuple(row.logprobs),
                    finish_reason=row.finish,
                    version_spans=row.version_spans(),
                    text=row.text,
                )
            )

    def _check_stop(self, row: _Row) -> bool:
        """Finish `row` on EOS / stop string / length; sets finish reason and text."""
        token = row.tokens[-1]
        limit = min(row.sampling.max_tokens, self._max_model_len - len(row.prompt))
        if token in self._eos:
            row.finish = FINISH_STOP
        elif row.sampling.stop:
            text = self._tokenizer.decode(row.tokens, skip_special_tokens=True)
            hits = [text.find(s) for s in row.sampling.stop if s in text]
            if hits:
                row.finish, row.text = FINISH_STOP, text[: min(hits)]
                return True
        if not row.finish and len(row.tokens) >= limit:
            row.finish = FINISH_LENGTH
        if row.finish:
            row.text = self._tokenizer.decode(row.tokens, skip_special_tokens=True)
        return bool(row.finish)

    @torch.inference_mode()
    def _prefill(self, rows: list[_Row]) -> _Batch:
        """A batch of `rows`: their prompts and the tokens they already have, left-padded, through the
        current weights (engine thread)."""
        from transformers import DynamicCache

        model = self._model
        device = next(model.parameters()).device
        pad = next(iter(self._eos), 0)
        seqs = [r.prompt + r.tokens for r in rows]
        width = max(len(q) for q in seqs)
        ids = torch.tensor([[pad] * (width - len(q)) + q for q in seqs], device=device)  # [B, L]
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in seqs], device=device)  # [B, L]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, L]
        cache = DynamicCache()
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1].float()  # fmt: skip  # [B, V]
        temperature = torch.tensor([r.sampling.temperature for r in rows], device=device)  # [B]
        return _Batch(rows, self._version, cache, mask, positions[:, -1:], logits, temperature)

    @torch.inference_mode()
    def _decode(self, batch: _Batch, slice_s: float) -> bool:
        """Sample tokens for the unfinished rows of `batch` until all are finished or `slice_s` has
        passed (engine thread), leaving the logits of every row's next token in `batch`. Rows an
        abandoned request left (`finish` set by `generate`) stop too. Returns True, sampling nothing,
        when the weights changed since `batch` was built (its cache and logits are of the old ones)."""
        if batch.version != self._version:
            return True
        deadline = time.perf_counter() + slice_s
        rows, model = batch.rows, self._model
        device = batch.logits.device
        pad = next(iter(self._eos), 0)
        top_k = [r.sampling.top_k for r in rows]
        top_p = [r.sampling.top_p for r in rows]
        active = [b for b, row in enumerate(rows) if not row.finish]
        while active:
            logprobs = processed_logprobs(batch.logits, batch.temperature, top_k, top_p)  # [B, V]
            probs = logprobs.exp()  # [B, V]
            next_ids = torch.full((len(rows),), pad, dtype=torch.long, device=device)  # [B]
            # unseeded rows in one draw, seeded ones each from its own generator; the tokens and their
            # logprobs leave the device once per step (not twice per row: on a GPU each is a sync)
            unseeded = [b for b in active if rows[b].generator is None]
            if unseeded:
                at = torch.tensor(unseeded, device=device)  # [U]
                next_ids[at] = torch.multinomial(probs[at], 1, generator=self._generator)[:, 0]
            for b in active:
                if rows[b].generator is not None:
                    next_ids[b] = torch.multinomial(probs[b], 1, generator=rows[b].generator)[0]
            chosen = logprobs.gather(-1, next_ids[:, None])[:, 0]  # [B]
            tokens, token_logprobs = next_ids.tolist(), chosen.tolist()
            for b in active:
                row = rows[b]
                if not row.spans or row.spans[-1][0] != batch.version:
                    row.spans.append((batch.version, len(row.tokens)))
                row.tokens.append(tokens[b])
                row.logprobs.append(token_logprobs[b])
            active = [b for b in active if not self._check_stop(rows[b])]  # also rows cancelled meanwhile
            if not active:
                break
            batch.mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)  # [B, L+1]
            batch.positions = batch.positions + 1  # [B, 1]
            batch.logits = model(
                input_ids=next_ids[:, None], attention_mask=batch.mask, position_ids=batch.positions,
                past_key_values=batch.cache, use_cache=True,
            ).logits[:, -1].float()  # fmt: skip  # [B, V]
            if time.perf_counter() > deadline:
                break
        return False

    # ------------------------------------------------------------------ scoring and weights
    @torch.inference_mode()
    def _score(self, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
        device = next(self._model.parameters()).device
        ids = torch.tensor([prompt + completion], device=device)  # [1, P+C]
        logits = self._model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [C, V]
        logprobs = torch.log_softmax(logits / temperature, dim=-1)  # [C, V]
        target = torch.tensor(completion, device=device)[:, None]  # [C, 1]
        return logprobs.gather(-1, target)[:, 0].tolist()

    async def score_tokens(
        self, prompt_token_ids: list[int], completion_token_ids: list[int], temperature: float
    ) -> list[float]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor, self._score, prompt_token_ids, completion_token_ids, temperature
        )

    def _swap_weights(self, plan: LoadPlan, manifest: Manifest, version: int) -> float:
        """Load a staged version: copied into the parameters (made our own first if they are borrowed),
        or, when the plan offers stable views in this engine's dtype and device (`zero_copy`:
        cuda_ipc), adopted as the parameters themselves. An adapter version: `_swap_adapter`."""
        started = time.perf_counter()
        if manifest.adapter is not None:
            self._swap_adapter(plan, manifest, version)
            return (time.perf_counter() - started) * 1e3
        # checked before any weight is touched
        adapters.check_layout(manifest, adapters.base_shapes(self._model), f"weights v{version}")
        if self._adapter is not None:  # whole weights after adapter versions: the base model again
            self._model, self._adapter = adapters.unwrapped(self._model), None
        current = self._model.state_dict()
        assert self._worker is not None
        with open_tensors(plan, list(manifest.tensors), self._worker) as tensors:
            state = dict(tensors)
            adopt = plan.zero_copy and all(
                t.dtype == current[n].dtype and t.device == current[n].device for n, t in state.items()
            )
            if not adopt:
                self._own()  # copying into borrowed parameters would write into the learner's buffer
            self._model.load_state_dict(state, strict=True, assign=adopt)
        self._borrowed = adopt
        del current, state  # the replaced parameters' last references: empty_cache can give them back
        if adopt and self._worker.device.type == "cuda":
            torch.cuda.empty_cache()  # the replaced parameters' memory goes back: no second copy held
        self._version = version
        return (time.perf_counter() - started) * 1e3

    def _swap_adapter(self, plan: LoadPlan, manifest: Manifest, version: int) -> None:
        """Load an adapter version: its tensors copied into the LoRA layers over the unchanged base
        (the model wrapped first when it is not, or not for this rank / alpha / modules)."""
        spec = manifest.adapter
        assert spec is not None and self._worker is not None
        adapters.check_adapter(self._model, manifest, version)  # before the model changes
        with open_tensors(plan, list(manifest.tensors), self._worker) as tensors:
            state = {name: t.detach().clone() for name, t in tensors}  # read whole before any change
        if spec != self._adapter:
            self._own()  # borrowed base weights (a cuda_ipc version) would change under the adapter
            self._model, self._adapter = adapters.wrapped(self._model, spec), spec
        adapters.load_adapter(self._model, state)
        self._version = version

    def _own(self) -> None:
        """Copy borrowed parameters into memory of our own (tensors that shared storage still do)."""
        if not self._borrowed:
            return
        copies: dict[tuple, torch.Tensor] = {}
        state = {}
        for name, tensor in self._model.state_dict().items():
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            state[name] = copies.setdefault(key, tensor.detach().clone())
        self._model.load_state_dict(state, strict=True, assign=True)
        self._borrowed = False
        log.info("weights copied out of the learner's buffer", version=self._version)

    async def own_weights(self) -> None:
        # `_borrowed` changes only in loads, which (like this call) run under Rollout's commit lock
        if not self._borrowed:
            return
        await asyncio.get_running_loop().run_in_executor(self._executor, self._own)

    async def load_weights(self, plan: LoadPlan, manifest: Manifest, version: int) -> LoadTimings:
        requested = time.perf_counter()
        loop = asyncio.get_running_loop()
        load_ms = await loop.run_in_executor(self._executor, self._swap_weights, plan, manifest, version)
        return LoadTimings(pause_ms=(time.perf_counter() - requested) * 1e3, load_ms=load_ms)

    async def call_workers(self, kind: str, op: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
        """This process is the one worker; transport operations run off the loop and off the engine
        thread (a collective receive must not stall generation)."""
        if self._worker is None:
            raise FailedPrecondition("the transformers engine is still loading")
        return await LocalWorkers(self._worker).call_workers(kind, op, spec)

    @property
    def weight_workers(self) -> int:
        return 1

    async def set_weight_version(self, version: int) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, setattr, self, "_version", version)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._max_model_len
