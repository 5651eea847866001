"""Rollout engine on plain transformers, for machines without vLLM (and fast unit tests).

Requests queue up (bounded) and a batcher runs them, `max_batch_size` samples at a time, in ONE
executor thread: prefill of the left-padded prompts, then token-by-token decoding with a KV cache.
Weight loads run in the same thread, so they happen between batches and every completion has a
single version span (the version at the start of its batch). Per-token logprobs are "processed":
log_softmax of logits / T after top-k / top-p truncation, matching vLLM's processed_logprobs.
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
from services.common.weights import Manifest, dtype_from_name
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
    finish: str = ""
    text: str = ""


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
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self._settings.hf.max_batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            batch = [row for row in batch if not row.finish]
            if not batch:
                continue
            try:
                version = await loop.run_in_executor(self._executor, self._generate_batch, batch)
            except Exception as exc:
                log.exception("transformers batch failed")
                for row in batch:
                    row.out.put_nowait(exc)
                continue
            for row in batch:
                row.out.put_nowait(
                    FinishedCompletion(
                        index=row.index,
                        token_ids=tuple(row.tokens),
                        logprobs=tuple(row.logprobs),
                        finish_reason=row.finish,
                        version_spans=(VersionSpan(version, 0, len(row.tokens)),) if row.tokens else (),
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
    def _generate_batch(self, rows: list[_Row]) -> int:
        """Sample every row to completion (runs in the engine thread). Returns the weight version used."""
        from transformers import DynamicCache

        version, model = self._version, self._model
        device = next(model.parameters()).device
        pad = next(iter(self._eos), 0)
        width = max(len(r.prompt) for r in rows)
        ids = torch.tensor(
            [[pad] * (width - len(r.prompt)) + r.prompt for r in rows], device=device
        )  # [B, P]
        mask = torch.tensor(
            [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in rows], device=device
        )  # [B, P]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        temperature = torch.tensor([r.sampling.temperature for r in rows], device=device)  # [B]
        top_k = [r.sampling.top_k for r in rows]
        top_p = [r.sampling.top_p for r in rows]
        cache = DynamicCache()
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1].float()  # fmt: skip  # [B, V]
        active = list(range(len(rows)))
        while active:
            logprobs = processed_logprobs(logits, temperature, top_k, top_p)  # [B, V]
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
                rows[b].tokens.append(tokens[b])
                rows[b].logprobs.append(token_logprobs[b])
            active = [b for b in active if not self._check_stop(rows[b])]
            if not active:
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # [B, P+t]
            positions = positions[:, -1:] + 1  # [B, 1]
            logits = model(
                input_ids=next_ids[:, None], attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True,
            ).logits[:, -1].float()  # fmt: skip  # [B, V]
        return version

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
        cuda_ipc), adopted as the parameters themselves."""
        started = time.perf_counter()
        current = self._model.state_dict()
        names = {t.name for t in manifest.tensors}
        if names != set(current):  # check before touching any weight
            raise FailedPrecondition(
                f"weights v{version} do not match the model: missing {sorted(set(current) - names)[:5]}, "
                f"unexpected {sorted(names - set(current))[:5]}"
            )
        for entry in manifest.tensors:
            if tuple(entry.shape) != tuple(current[entry.name].shape):
                raise FailedPrecondition(
                    f"weights v{version}: {entry.name} has shape {list(entry.shape)}, "
                    f"the model {list(current[entry.name].shape)}"
                )
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
