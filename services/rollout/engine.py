"""The inference-engine seam of the rollout service: what any engine (vLLM, plain transformers) provides.

The service logic (`rollout.py`) only talks to a `RolloutEngine`; it owns tokenization, admission
control, validation and weight staging. Engines own sampling, behaviour logprobs, version stamping
and in-place weight loads. All values crossing this seam are plain Python (no protos, no vLLM types);
a staged weight version arrives as a transport's `LoadPlan`, opened where the engine loads
(`services.transports.registry.open_tensors`), so engines know no transport.

Logprob convention (shared with the learner): the behaviour logprob of a sampled token is the
"processed" logprob log_softmax(logits / temperature)[token] (after top-k/top-p truncation and
renormalisation when those are on).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.common.weights import Manifest
from services.transports import LoadPlan

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling parameters (already validated)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    seed: int = 0  # 0 = unseeded
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class VersionSpan:
    """Completion tokens [start, end) were sampled by weight version `version`."""

    version: int
    start: int
    end: int


@dataclass(frozen=True)
class FinishedCompletion:
    """One finished sample of a request (index within its group of n)."""

    index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # processed logprob of each sampled token
    finish_reason: str  # FINISH_STOP | FINISH_LENGTH | FINISH_ABORT
    version_spans: tuple[VersionSpan, ...]
    text: str


@dataclass(frozen=True)
class LoadTimings:
    """What a weight commit cost: total pause of generation and the load itself (ms)."""

    pause_ms: float
    load_ms: float
    extra: dict[str, float] = field(default_factory=dict)


class RolloutEngine(abc.ABC):
    """An engine that samples completions with behaviour logprobs and takes in-place weight updates."""

    name: str = ""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model (version 0). Called once, inside the service's running event loop."""

    @abc.abstractmethod
    def generate(
        self, prompt_token_ids: list[int], sampling: Sampling, request_id: str
    ) -> AsyncIterator[list[FinishedCompletion]]:
        """Yield the `sampling.n` completions as soon as they finish (any order), those that finished
        together (in one engine step or batch) in one list, so the service sends them in one message.

        Closing the iterator early aborts the unfinished samples.
        """

    @abc.abstractmethod
    async def score_tokens(
        self, prompt_token_ids: list[int], completion_token_ids: list[int], temperature: float
    ) -> list[float]:
        """log_softmax(logits / temperature) of each completion token under the current weights."""

    @abc.abstractmethod
    async def load_weights(self, plan: LoadPlan, manifest: Manifest, version: int) -> LoadTimings:
        """Load a full state_dict, laid out per `manifest`, from a staged version's `plan`; or, when
        `manifest.adapter` is set (engines whose `adapters_refused` is ""), a LoRA adapter over the base
        model, which every later token is sampled and scored under.

        Pauses generation (unfinished requests keep their place), loads in place, resets the
        prefix cache, stamps subsequent tokens with `version` and resumes.
        """

    @abc.abstractmethod
    async def call_workers(self, kind: str, op: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
        """Run weight transport `kind`'s worker operation `op` in every process that holds the model
        (each vLLM worker; the transformers engine's own process) and return each one's reply."""

    @abc.abstractmethod
    async def own_weights(self) -> None:
        """Make the loaded weights this engine's own memory if they are views of someone else's.

        After a zero-copy load (cuda_ipc) the parameters ARE the learner's staging buffer, which the
        learner rewrites two versions later; a rollout dropped from the next sync calls this so it
        never generates on bytes that change under it. Engines that always copy have nothing to do.
        """

    #: Why this engine cannot serve a LoRA adapter version (WeightVersion.adapter), "" when it can:
    #: `load_weights` then takes an adapter manifest too, serving it over the base model it started with.
    adapters_refused: str = (
        "this engine does not serve LoRA adapters; publish merged weights (learner "
        "--publish.export-format full)"
    )

    #: Whether the model computes in the rollout's own process (its threads) rather than in processes
    #: the engine starts; only then must the rollout process keep the engine's cores (`service_cpus`).
    computes_in_process: bool = True

    @property
    @abc.abstractmethod
    def weight_workers(self) -> int:
        """How many processes hold the model (and receive collective weight transfers)."""

    @abc.abstractmethod
    async def set_weight_version(self, version: int) -> None:
        """Label subsequently generated tokens with `version` (no weight change)."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """The version tokens are currently stamped with."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Context length in tokens (prompt + completion) the loaded model accepts."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Abort outstanding work and release the engine (idempotent)."""
