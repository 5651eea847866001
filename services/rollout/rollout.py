"""The rollout worker's logic: admission, tokenization, generation bookkeeping, the weight-sync phases.

Protocol-free: the servicer converts protos to the domain objects used here and back. Heavy work
(tokenizing long prompts, model forward passes, checksum hashing) runs off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib.util
import os
import socket
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from services.common import validation as check
from services.common.cpus import BusyFile, move_process_threads
from services.common.errors import Aborted, GrpoError, InvalidArgument, ResourceExhausted, Unavailable, quoted
from services.common.logging import get_logger
from services.rollout.config import RolloutSettings
from services.rollout.engine import FinishedCompletion, LoadTimings, RolloutEngine, Sampling
from services.rollout.hf_engine import HfEngine
from services.rollout.templates import MessageInput, Rendered, TemplateRenderer
from services.rollout.validation import (
    PromptInput,
    normalize_sampling,
    validate_prompt,
    validate_prompt_tokens,
    validate_render_request,
    validate_sampling,
    validate_score_request,
)
from services.rollout.vllm_engine import VllmEngine
from services.rollout.weight_sync import WeightStager
from services.transports import Staged, StageTarget
from services.transports.shared_memory import reclaim_stale_segments

log = get_logger(__name__)

# Plain-text prompts up to this many characters are tokenized on the event loop (well under a
# millisecond); longer ones and chat messages in the tokenizer threads.
INLINE_TOKENIZE_CHARS = 512


class Status(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    UPDATING = "updating"
    DRAINING = "draining"


@dataclass(frozen=True)
class Generated:
    """Completions of one request that finished together, with the request facts the caller records
    next to them (`prompt_token_ids` empty for a token-in request: the caller has them)."""

    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: Sampling
    completions: tuple[FinishedCompletion, ...]


@dataclass(frozen=True)
class BatchRequest:
    """One request of `Rollout.generate_many`."""

    request_id: str
    prompt: PromptInput
    sampling: Sampling


@dataclass(frozen=True)
class BatchOutput:
    """Completions of one request of a batch that finished together, or the error that ended it."""

    request_id: str
    generated: Generated | None = None
    error: GrpoError | None = None


_REQUEST_ENDED = None  # what a batch's request task queues when it is done


@dataclass(frozen=True)
class RolloutState:
    rollout_id: str
    weight_version: int
    staged_version: int
    status: Status
    engine: str
    model: str
    in_flight: int
    max_in_flight: int
    tokens_generated: int
    weight_workers: int
    instance_id: str
    max_model_len: int  # 0 while loading


@dataclass(frozen=True)
class CommitResult:
    version: int
    timings: LoadTimings


def vllm_available() -> bool:
    """True when vLLM is installed (the CPU or CUDA build); checked without importing it."""
    return importlib.util.find_spec("vllm") is not None


def build_engine(settings: RolloutSettings) -> RolloutEngine:
    """The engine `settings.engine` asks for (auto: vLLM when importable, else transformers)."""
    kind = settings.engine
    if kind == "auto":
        kind = "vllm" if vllm_available() else "transformers"
    return VllmEngine(settings) if kind == "vllm" else HfEngine(settings)


class Rollout:
    """A rollout worker: one engine, one tokenizer, one staged-weights slot."""

    def __init__(self, settings: RolloutSettings, engine: RolloutEngine | None = None) -> None:
        self.settings = settings
        self.rollout_id = settings.rollout_id or f"{socket.gethostname()}-{os.getpid()}"
        self.instance_id = uuid.uuid4().hex[:12]  # a restarted rollout is a new group member
        self._engine = engine or build_engine(settings)
        self._stager = WeightStager(
            self.rollout_id, settings.fetch_deadline, self._engine, self._engine.adapters_refused
        )
        self._tokenize_pool = ThreadPoolExecutor(settings.tokenize_threads, thread_name_prefix="tokenize")
        self._tokenizer: Any = None
        self._renderer: TemplateRenderer | None = None
        self._vocab_size = 0
        self._status = Status.LOADING
        self._in_flight: set[str] = set()
        self._busy = BusyFile(settings.busy_file) if settings.busy_file else None
        self._tokens_generated = 0
        self._commit_lock = asyncio.Lock()

    @property
    def engine(self) -> RolloutEngine:
        return self._engine

    # ------------------------------------------------------------------ lifecycle
    def _load_tokenizer(self) -> None:
        from transformers import AutoConfig, AutoTokenizer  # heavy: imported on the tokenizer thread

        source = self.settings.tokenizer or self.settings.model
        self._tokenizer = AutoTokenizer.from_pretrained(
            source, trust_remote_code=self.settings.trust_remote_code
        )
        config = AutoConfig.from_pretrained(
            self.settings.model, trust_remote_code=self.settings.trust_remote_code
        )
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._vocab_size = int(getattr(text_config, "vocab_size", 0) or len(self._tokenizer))
        self._renderer = TemplateRenderer(self._tokenizer)

    async def start(self) -> None:
        # what a predecessor of this id left in /dev/shm when it was killed with its resource tracker
        await asyncio.to_thread(reclaim_stale_segments, self.rollout_id)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._tokenize_pool, self._load_tokenizer)
        await self._engine.start()
        if self.settings.service_cpus and not self._engine.computes_in_process:
            move_process_threads(self.settings.service_cpus)  # the engine's processes keep `cpus`
        self._status = Status.READY
        log.info(
            "rollout ready", rollout_id=self.rollout_id, engine=self._engine.name, model=self.settings.model
        )

    async def stop(self) -> None:
        self._status = Status.DRAINING
        await self._engine.stop()
        self._stager.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if self._busy:
            self._busy.set(False)
            self._busy.close()

    # ------------------------------------------------------------------ generation
    def _tokenize(self, prompt: PromptInput) -> list[int]:
        tokenizer = self._tokenizer
        if prompt.messages:
            if not getattr(tokenizer, "chat_template", None):
                raise InvalidArgument(
                    f"prompt {prompt.prompt_id!r} has chat messages but the tokenizer has no chat template"
                )
            assert self._renderer is not None
            messages = [MessageInput(role, content) for role, content in prompt.messages]
            return self._renderer.conversation(messages, prompt.tools_json, add_generation_prompt=True)
        return list(tokenizer(prompt.text, add_special_tokens=self.settings.add_special_tokens)["input_ids"])

    async def tokenize(self, prompt: PromptInput) -> list[int]:
        """Prompt token ids (chat template with generation prompt for messages).

        A short plain-text prompt is tokenized right here: that takes tens of microseconds, less than
        the hand-off to a thread and back (~150 us of CPU, measured). Chat messages and longer texts
        are tokenized in a thread.
        """
        if not prompt.messages and len(prompt.text) <= INLINE_TOKENIZE_CHARS:
            ids = self._tokenize(prompt)
        else:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._tokenize_pool, self._tokenize, prompt)
        if not ids:
            raise InvalidArgument(f"prompt {prompt.prompt_id!r} tokenizes to zero tokens")
        if len(ids) >= self._engine.max_model_len:
            raise InvalidArgument(
                f"prompt {prompt.prompt_id!r} has {len(ids)} tokens; "
                f"max_model_len is {self._engine.max_model_len}"
            )
        return ids

    def _admit(self, request_id: str) -> None:
        if self._status in (Status.LOADING, Status.DRAINING):
            raise Unavailable(f"rollout {self.rollout_id} is {self._status.value}")
        if request_id in self._in_flight:
            raise InvalidArgument(f"request_id {request_id!r} is already in flight")
        if len(self._in_flight) >= self.settings.max_in_flight:
            raise ResourceExhausted(
                f"rollout {self.rollout_id} has {len(self._in_flight)} requests in flight (max_in_flight "
                f"{self.settings.max_in_flight}); retry later"
            )

    async def generate(
        self, request_id: str, prompt: PromptInput, sampling: Sampling
    ) -> AsyncIterator[Generated]:
        """Validate, admit, tokenize (unless the prompt is given as token ids) and stream the request's
        completions as they finish (those that finished together in one `Generated`)."""
        sampling = normalize_sampling(sampling)
        limits = self.settings.limits
        validate_prompt(prompt, limits)
        check.text_id(request_id, "request_id", limits.max_id_chars)
        self._admit(request_id)  # UNAVAILABLE while loading: the context length is known after it
        validate_sampling(sampling, limits, self._engine.max_model_len)
        if prompt.token_ids:
            validate_prompt_tokens(
                prompt.token_ids, sampling.max_tokens, self._vocab_size, self._engine.max_model_len
            )
        self._in_flight.add(request_id)
        try:
            with self._working():
                if prompt.token_ids:
                    prompt_ids, prompt_tuple = list(prompt.token_ids), ()  # the caller has them
                else:
                    prompt_ids = await self.tokenize(prompt)
                    prompt_tuple = tuple(prompt_ids)  # once per request, shared by its completions
                    if len(prompt_ids) + sampling.max_tokens > self._engine.max_model_len:  # as token-in
                        raise InvalidArgument(
                            f"prompt {prompt.prompt_id!r} has {len(prompt_ids)} tokens; with "
                            f"sampling_params.max_tokens {sampling.max_tokens} that is more than "
                            f"max_model_len {self._engine.max_model_len}"
                        )
                async for finished in self._engine.generate(prompt_ids, sampling, request_id):
                    self._tokens_generated += sum(len(c.token_ids) for c in finished)
                    yield Generated(prompt.prompt_id, prompt_tuple, sampling, tuple(finished))
        finally:
            self._in_flight.discard(request_id)

    async def generate_many(self, requests: Sequence[BatchRequest]) -> AsyncIterator[list[BatchOutput]]:
        """Several requests at once, each checked, admitted and generated as `generate` does, their
        outputs merged as they come: one list per wake-up holding everything finished since the last
        (with vLLM: the completions of every request that finished in one engine step). A request's
        domain error (invalid, over capacity, an id already in flight) is its last output and the
        others go on; anything else ends the batch. Closing the iterator cancels the requests still
        running."""
        if not requests:
            raise InvalidArgument("the batch has no requests")
        if len(requests) > self.settings.max_in_flight:
            raise ResourceExhausted(
                f"a batch of {len(requests)} requests is more than rollout {self.rollout_id} takes at once "
                f"(max_in_flight {self.settings.max_in_flight})"
            )
        seen: set[str] = set()
        for request in requests:
            if request.request_id in seen:  # its results could not be told apart
                raise InvalidArgument(f"request_id {quoted(request.request_id)} appears twice in the batch")
            seen.add(request.request_id)
        outputs: asyncio.Queue[BatchOutput | Exception | None] = asyncio.Queue()  # ≤ n + 1 per request

        async def run(request: BatchRequest) -> None:
            try:
                async for generated in self.generate(request.request_id, request.prompt, request.sampling):
                    outputs.put_nowait(BatchOutput(request.request_id, generated))
            except GrpoError as exc:  # logged as the interceptor logs a rejected call
                log.info(
                    "batch request rejected",
                    batch_request=request.request_id,
                    code=exc.code.name,
                    error=str(exc),
                )
                outputs.put_nowait(BatchOutput(request.request_id, error=exc))
            except Exception as exc:  # an engine failure: the whole batch fails, as a Generate would
                outputs.put_nowait(exc)
            finally:
                outputs.put_nowait(_REQUEST_ENDED)

        tasks = [asyncio.create_task(run(request)) for request in requests]
        running = len(tasks)
        try:
            while running:
                ready = [await outputs.get()]
                while not outputs.empty():
                    ready.append(outputs.get_nowait())
                merged = []
                for item in ready:
                    if item is _REQUEST_ENDED:
                        running -= 1
                    elif isinstance(item, Exception):
                        raise item
                    else:
                        merged.append(item)
                if merged:
                    yield merged
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def render(
        self,
        mode: str,
        messages: Sequence[MessageInput] = (),
        tools_json: str = "",
        add_generation_prompt: bool = False,
        previous_tail: Sequence[int] = (),
        text: str = "",
    ) -> Rendered:
        """Tokens (and their text) of `messages` through the chat template, or of `text` (mode
        "conversation", "bridge" or "text"; see `templates.py`), rendered in a tokenizer thread."""
        if self._renderer is None:
            raise Unavailable(f"rollout {self.rollout_id} is still loading")
        validate_render_request(
            mode, messages, tools_json, previous_tail, text, self.settings.limits, self._vocab_size
        )
        renderer = self._renderer

        def run() -> Rendered:
            if mode == "text":
                ids = renderer.text(text)
            elif mode == "bridge":
                ids = renderer.bridge(messages, previous_tail, tools_json, add_generation_prompt)
            else:
                ids = renderer.conversation(messages, tools_json, add_generation_prompt)
            return Rendered(ids, renderer.decode(ids))

        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, run)

    def _working(self) -> contextlib.AbstractContextManager[None]:
        """Marks the busy file (if any) for the duration: a learner borrowing this rollout's cores
        looks at it before each pass and each decoder layer's. Generation, scoring and both sync phases
        are work here (the scheduler lets the learner train while the rollouts stage and commit)."""
        return self._busy.working() if self._busy else contextlib.nullcontext()

    async def score(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> tuple[list[float], int]:
        """Processed logprobs of the completion tokens and the version they were computed with."""
        if self._status == Status.LOADING:
            raise Unavailable(f"rollout {self.rollout_id} is still loading")
        validate_score_request(
            prompt_ids, completion_ids, temperature, self._vocab_size, self._engine.max_model_len
        )
        async with self._commit_lock:  # never straddle a weight update
            version = self._engine.weight_version
            with self._working():
                logprobs = await self._engine.score_tokens(prompt_ids, completion_ids, temperature)
        return logprobs, version

    # ------------------------------------------------------------------ weights
    async def stage_weights(self, target: StageTarget, rewind: bool = False) -> Staged:
        with self._working():
            return await self._stager.stage(target, self._engine.weight_version, rewind)

    async def commit_weights(self, version: int, rewind: bool = False) -> CommitResult:
        """Load the staged `version` (idempotent when it is already the loaded one). `rewind`: also an
        older version (the learner restarted from an older checkpoint)."""
        async with self._commit_lock:
            current = self._engine.weight_version
            if version == current and self._stager.staged_version != version:
                return CommitResult(version, LoadTimings(0.0, 0.0))
            if version < current and not rewind:
                raise Aborted(f"weight version {version} is older than the loaded version {current}")
            staged = await self._stager.take(version)
            previous, self._status = self._status, Status.UPDATING
            try:
                with self._working():
                    timings = await self._engine.load_weights(staged.plan, staged.manifest, version)
            except BaseException:
                await self._stager.put_back(staged)  # a retried CommitWeights can load it again
                raise
            else:
                staged.release()
            finally:
                self._status = previous if previous != Status.UPDATING else Status.READY
            log.info(
                "weights committed",
                version=version,
                load_ms=round(timings.load_ms, 1),
                pause_ms=round(timings.pause_ms, 1),
            )
            return CommitResult(version, timings)

    async def abort_weights(self, version: int) -> None:
        """Drop a staged `version` this rollout will not commit. The loaded weights stay, made our
        own first if they are views of the learner's buffer: the learner reuses that buffer for the
        version after `version`, and this rollout keeps generating until it is synced again."""
        if await self._stager.abort(version):
            log.info("staged weights dropped", version=version)
        async with self._commit_lock:
            await self._engine.own_weights()

    def state(self) -> RolloutState:
        return RolloutState(
            rollout_id=self.rollout_id,
            weight_version=self._engine.weight_version,
            staged_version=self._stager.staged_version,
            status=self._status,
            engine=self._engine.name,
            model=self.settings.model,
            in_flight=len(self._in_flight),
            max_in_flight=self.settings.max_in_flight,
            tokens_generated=self._tokens_generated,
            weight_workers=self._engine.weight_workers,
            instance_id=self.instance_id,
            max_model_len=0 if self._status == Status.LOADING else self._engine.max_model_len,
        )
