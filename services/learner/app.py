"""LearnerApp: the service object the server skeleton runs (services/common/serve.py ServiceApp).

It owns the Trainer and the store of prepared weight versions, and runs every model operation
(load, train step, scoring, weight snapshot + packing, checkpoint) on ONE dedicated worker thread:
the event loop never blocks, and the model is never used by two operations at once. Calls queue
behind each other in arrival order; a second TrainStep while one is queued or running is refused
with ResourceExhausted (backpressure instead of an unbounded queue).
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import grpc

from grpo.learner.v1 import learner_pb2_grpc
from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from services.common.logging import get_logger
from services.learner.batching import Sample, validate_sample
from services.learner.config import LearnerSettings
from services.learner.publish import Prepared, PreparedStore
from services.learner.trainer import StepOutcome, Trainer

log = get_logger(__name__)
T = TypeVar("T")

SERVICE_NAME = "grpo.learner.v1.LearnerService"
_ANY_HOST = {"", "0.0.0.0", "::", "[::]"}


@dataclass
class LearnerState:
    weight_version: int
    step: int
    model: str
    loss: str
    prepared_versions: list[int]
    device: str
    dtype: str


class LearnerApp:
    """Domain operations of the learner, each async and safe to call from RPC handlers."""

    service_names = (SERVICE_NAME,)

    def __init__(self, settings: LearnerSettings) -> None:
        if not settings.model:
            raise ValueError("--model is required (HF id or local directory)")
        self.settings = settings
        self.run_id = uuid.uuid4().hex[:8]
        self.store = PreparedStore(self.run_id, settings.max_prepared_versions)
        self.trainer: Trainer | None = None
        self.bound_port: int | None = None  # set by server wiring/tests when port 0 was requested
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner-model")
        self._train_pending = False

    # ------------------------------------------------------------------ ServiceApp

    def register(self, server: grpc.aio.Server) -> None:
        from services.learner.servicer import LearnerServicer

        learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(self), server)

    async def start(self) -> None:
        started = time.perf_counter()
        self.trainer = await self._run(lambda: Trainer(self.settings.trainer_options()))
        log.info(
            "learner ready",
            model=self.settings.model,
            loss=self.settings.loss,
            device=str(self.trainer.device),
            weight_version=self.trainer.weight_version,
            load_s=round(time.perf_counter() - started, 2),
        )

    async def stop(self) -> None:
        """Checkpoint (if configured), free prepared versions, stop the worker thread."""
        if self.trainer is not None and self.settings.checkpoint_dir is not None:
            await self._run(self.trainer.save_checkpoint)
        self.store.close()
        # The checkpoint above ran after every queued job, so the worker is idle, unless start() was
        # cancelled mid-load: never block the event loop waiting for that load to finish.
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ operations

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _ready(self) -> Trainer:
        if self.trainer is None:
            raise FailedPrecondition("learner model is not loaded yet")
        return self.trainer

    async def train_step(
        self, samples: list[Sample], batch_id: str, step: int, rewards: list[float]
    ) -> StepOutcome:
        """One optimizer step. A retry of the last batch (same batch_id) returns its result again."""
        trainer = self._ready()
        if not samples:
            raise InvalidArgument("batch has no completions")
        if self._train_pending:
            raise ResourceExhausted("a train step is already running; wait for its result")
        self._train_pending = True
        try:
            return await self._run(lambda: self._train(trainer, samples, batch_id, step, rewards))
        finally:
            self._train_pending = False

    def _train(self, trainer: Trainer, samples: list[Sample], batch_id: str, step: int, rewards: list[float]):
        for index, sample in enumerate(samples):  # O(tokens): on the worker thread, not the loop
            validate_sample(sample, trainer.vocab_size, f"completion {index}", trainer.max_length)
        if batch_id and batch_id == trainer.last_batch_id:
            # a retry (or, after --resume, the last batch the checkpoint already consumed)
            log.info("duplicate batch: not training it again", batch_id=batch_id)
            return trainer.last_outcome or StepOutcome(
                trainer.step, trainer.weight_version, {"duplicate": 1.0}
            )
        if self.settings.strict_step and step != trainer.step:
            raise FailedPrecondition(
                f"batch {batch_id!r} is for step {step} but the learner is at step {trainer.step}"
            )
        return trainer.train_step(samples, batch_id, rewards)

    async def prepare_weights(self, kind: str) -> tuple[Prepared, float]:
        """Snapshot + pack the current weights (kind: grpc_stream | shared_memory)."""
        trainer = self._ready()
        if kind == "grpc_stream":
            self.advertise_address()  # fail before the expensive pack if no address is known

        def prepare() -> tuple[Prepared, float]:
            started = time.perf_counter()
            version = trainer.weight_version
            existing = self.store.existing(version, kind)
            if existing is not None:
                return existing, 0.0
            self.store.check_capacity()
            item = self.store.prepare(version, kind, trainer.export())
            return item, (time.perf_counter() - started) * 1e3

        item, ms = await self._run(prepare)
        log.info(
            "weights prepared",
            version=item.version,
            kind=kind,
            bytes=item.manifest.total_bytes,
            ms=round(ms, 1),
        )
        return item, ms

    async def fetch_chunks(self, version: int, buckets: list[int]) -> AsyncIterator[tuple[int, int, bytes]]:
        """Chunks of a prepared version; yields to the loop between chunks."""
        for chunk in self.store.chunks(version, buckets, self.settings.weight_chunk_bytes):
            yield chunk
            await asyncio.sleep(0)

    async def release_weights(self, version: int) -> None:
        self.store.release(version)
        log.info("weights released", version=version)

    async def score(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> tuple[list[float], int]:
        """Logprobs of completion tokens under the current weights, and that weight version."""
        trainer = self._ready()
        if temperature < 0:
            raise InvalidArgument("temperature must be >= 0 (0 means 1.0, like vLLM greedy logprobs)")
        sample = Sample(
            tuple(prompt_ids), tuple(completion_ids), (0.0,) * len(completion_ids), 0.0, temperature or 1.0
        )
        validate_sample(sample, trainer.vocab_size, "sequence", trainer.max_length)
        return await self._run(
            lambda: (trainer.score(prompt_ids, completion_ids, temperature or 1.0), trainer.weight_version)
        )

    def state(self) -> LearnerState:
        trainer = self._ready()
        return LearnerState(
            weight_version=trainer.weight_version,
            step=trainer.step,
            model=self.settings.model,
            loss=self.settings.loss,
            prepared_versions=self.store.versions(),
            device=str(trainer.device),
            dtype=str(trainer.compute_dtype).removeprefix("torch."),
        )

    def advertise_address(self) -> str:
        """host:port rollouts dial for FetchWeights."""
        if self.settings.advertise_address:
            return self.settings.advertise_address
        port = self.bound_port or self.settings.port
        if not port:
            raise FailedPrecondition("learner address unknown: set --advertise-address or a fixed --port")
        host = socket.gethostname() if self.settings.host in _ANY_HOST else self.settings.host
        return f"{host}:{port}"
