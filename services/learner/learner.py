"""The learner: one model, its optimizer steps, and the weight versions it publishes.

Every model operation (load, train step, scoring, weight export + packing, checkpoint snapshot, going
back to an older checkpoint) runs on ONE dedicated worker thread (the trainer's writer thread then
writes a checkpoint's files): the event loop never blocks, and the model is never used by two
operations at once. That includes turning a request into samples: `train_step` takes a decoder that
the thread runs, and `score` builds and validates its sequence there, so the O(tokens) conversion and
validation of a big batch never stall health checks or FetchWeights; and pushing weights (an nccl
broadcast), which runs in the same job as packing them, so no optimizer step can interleave. Calls
queue behind each other in arrival order; a second TrainStep while one is queued or running is
refused with ResourceExhausted (backpressure instead of an unbounded queue).
"""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from services.common import validation as check
from services.common.deadlines import TransferDeadline
from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.common.logging import get_logger
from services.common.weights import LoraSpec, dtype_name
from services.learner import checkpoint as ckpt
from services.learner import ranks as ranked
from services.learner import sharding
from services.learner.batching import Sample, validate_sample
from services.learner.config import LearnerSettings
from services.learner.model import resolve_device
from services.learner.publish import PreparedStore
from services.learner.ranks import Leader
from services.learner.sharding import Ranks
from services.learner.trainer import StepOutcome, Trainer
from services.transports import Prepared, PublishContext, Receiver, TransportKind
from services.transports import registry as transports
from services.transports.cuda_ipc_fence import HOLDERS_KEY, Holder
from services.transports.grpc_stream import chunks, delta_ready

log = get_logger(__name__)
T = TypeVar("T")

_ANY_HOST = {"", "0.0.0.0", "::", "[::]"}
# What a TrainStep decoder returns: the samples to train on and the rewards they came with.
Decoded = tuple[list[Sample], list[float]]


@dataclass(frozen=True)
class Restored:
    step: int
    weight_version: int
    last_batch_id: str
    previous_step: int


@dataclass(frozen=True)
class LearnerState:
    weight_version: int
    step: int
    model: str
    loss: str
    prepared_versions: list[int]
    device: str
    dtype: str
    last_batch_id: str
    lineage_id: str
    instance_id: str
    ranks: int
    sharded: bool


def _resolve(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _log_publish_failure(job: asyncio.Future) -> None:
    """A publish that raised after its version was described (transports log their own failures)."""
    if not job.cancelled() and job.exception() is not None:
        log.error("publishing weights failed", error=f"{type(job.exception()).__name__}: {job.exception()}")


class Learner:
    """Domain operations of the learner, each async and safe to call from RPC handlers."""

    def __init__(self, settings: LearnerSettings) -> None:
        self.settings = settings
        self.run_id = uuid.uuid4().hex[:8]
        self.store = PreparedStore(settings.publish.max_prepared_versions)
        self.trainer: Trainer | Leader | None = None
        self.ranks: Ranks | None = None  # the learner's ranks under torchrun (this is rank 0)
        self._heartbeats: asyncio.Task | None = None
        self.bound_port: int | None = None  # the port actually bound (matters with --port 0)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner-model")
        self._train_pending = False
        self._publish = PublishContext(
            run_id=self.run_id,
            bucket_bytes=settings.publish.bucket_bytes,
            chunk_bytes=settings.publish.chunk_bytes,
            advertise_address=self.advertise_address,
            collective_timeout_s=settings.publish.collective_timeout_s,
            collective_transfer=TransferDeadline(
                floor_s=settings.publish.collective_timeout_s,
                min_rate_mb_s=settings.publish.collective_min_rate_mb_s,
            ),
            collective_port=settings.publish.collective_port,
            delta=settings.publish.delta,
        )

    async def start(self) -> None:
        started = time.perf_counter()
        settings = self.settings
        self.ranks = await self._run(
            lambda: sharding.join(resolve_device(settings.device), settings.distributed)
        )
        self.trainer = await self._run(lambda: ranked.build(settings, self.ranks))
        if self.ranks is not None:
            self._heartbeats = asyncio.create_task(self._heartbeat(), name="learner-rank-heartbeats")
        log.info(
            "learner ready",
            model=self.settings.model,
            loss=self.settings.loss.kind,
            device=str(self.trainer.device),
            weight_version=self.trainer.weight_version,
            load_s=round(time.perf_counter() - started, 2),
            ranks=self.ranks.world if self.ranks else 1,
        )

    async def _heartbeat(self) -> None:
        """Rank 0 tells the other ranks it is alive a few times per their idle deadline (queued on the
        model thread like any operation, so never inside another)."""
        while True:
            await asyncio.sleep(self.settings.distributed.idle_timeout_s / 4)
            trainer = self.trainer
            if isinstance(trainer, Leader):
                await self._run(trainer.heartbeat)

    async def stop(self) -> None:
        """Checkpoint (if configured), free prepared versions, stop the worker thread."""
        if self._heartbeats is not None:
            self._heartbeats.cancel()
        if self.trainer is not None and self.settings.checkpoint.dir is not None:
            await self._run(self.trainer.save_checkpoint)
        if isinstance(self.trainer, Leader):  # the other ranks leave the group and exit
            await self._run(self.trainer.stop)
            await self._run(sharding.leave)
        self.store.close()
        # The checkpoint above ran after every queued job, so the worker is idle, unless start() was
        # cancelled mid-load: never block the event loop waiting for that load to finish.
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _ready(self) -> Trainer:
        if self.trainer is None:
            raise Unavailable("learner model is still loading; retry shortly")
        return self.trainer

    # ------------------------------------------------------------------ training

    async def train_step(self, decode: Callable[[], Decoded], batch_id: str, step: int) -> StepOutcome:
        """One optimizer step on what `decode()` returns (run on the model thread, with validation).

        A retry of the last batch (same batch_id) returns its result again instead of training twice.
        """
        trainer = self._ready()
        if self._train_pending:
            raise ResourceExhausted("a train step is already running; wait for its result")
        self._train_pending = True
        try:
            return await self._run(lambda: self._train(trainer, decode, batch_id, step))
        finally:
            self._train_pending = False

    def _train(
        self, trainer: Trainer, decode: Callable[[], Decoded], batch_id: str, step: int
    ) -> StepOutcome:
        samples, rewards = decode()
        for index, sample in enumerate(samples):
            validate_sample(sample, trainer.vocab_size, f"completion {index}", trainer.max_length)
        if batch_id and batch_id == trainer.last_batch_id:
            # a retry (or, after --checkpoint.resume, the last batch the checkpoint already consumed)
            log.info("duplicate batch: not training it again", batch_id=batch_id)
            return trainer.last_outcome or StepOutcome(
                trainer.step, trainer.weight_version, {"duplicate": 1.0}
            )
        if self.settings.strict_step and step != trainer.step:
            raise FailedPrecondition(
                f"batch {batch_id!r} is for step {step} but the learner is at step {trainer.step}"
            )
        return trainer.train_step(samples, batch_id, rewards)

    async def score(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> tuple[list[float], int]:
        """Logprobs of completion tokens under the current weights, and that weight version."""
        trainer = self._ready()
        check.temperature(temperature, "sequence.temperature")

        def score() -> tuple[list[float], int]:  # on the model thread: building + validating is O(tokens)
            sample = Sample(
                tuple(prompt_ids), tuple(completion_ids), (0.0,) * len(completion_ids), 0.0, temperature
            )
            validate_sample(sample, trainer.vocab_size, "sequence", trainer.max_length)
            return trainer.score(sample), trainer.weight_version

        return await self._run(score)

    async def restore(self, lineage_id: str, max_step: int, min_step: int) -> Restored:
        """Go back to the newest checkpoint at or before `max_step` (step 0, the model as loaded, when
        there is none): the run's ledger lost the steps after it. A learner at or before `max_step`
        changes nothing (a retried call). Refused, with nothing changed, for another lineage or when
        the checkpoint found is older than `min_step`.

        On the model thread, after whatever is queued there: the checkpoints newer than the one found
        are removed first (`checkpoint.discard_after`: a learner that dies mid-way restarts from the
        right one), prepared versions are freed (their numbers will name other weights), and the
        trainer is rebuilt from that checkpoint; calls meanwhile answer UNAVAILABLE.
        """
        if not lineage_id:
            raise InvalidArgument("lineage_id is required: the lineage the caller's ledger recorded")
        if max_step < 0 or min_step < 0 or min_step > max_step:
            raise InvalidArgument(f"bad step range: min_step {min_step}, max_step {max_step}")
        trainer = self._ready()
        return await self._run(lambda: self._restore(trainer, lineage_id, max_step, min_step))

    def _restore(self, trainer: Trainer | Leader, lineage_id: str, max_step: int, min_step: int) -> Restored:
        own = trainer.lineage_id or self.run_id
        if lineage_id != own:
            raise FailedPrecondition(
                f"this learner is of lineage {own}, not {lineage_id}: refusing to go back"
            )
        previous = trainer.step
        if previous <= max_step:
            return Restored(previous, trainer.weight_version, trainer.last_batch_id, previous)
        root = self.settings.checkpoint.dir
        if trainer.writer is not None:
            trainer.writer.wait_quietly()  # a checkpoint under way counts (or is gone) before we look
        kept = [ckpt.step_of(p) for p in ckpt.list_checkpoints(root)] if root is not None else []
        target = max((s for s in kept if s <= max_step), default=0)
        if target < min_step:
            raise FailedPrecondition(
                f"no checkpoint at or before step {max_step} and at or after step {min_step} "
                f"(checkpoints: {kept}): cannot go back"
            )
        self.trainer = None  # UNAVAILABLE while the trainer is rebuilt
        trainer.close()
        discarded = ckpt.discard_after(root, target) if root is not None else []
        self.store.close()
        del trainer
        gc.collect()
        settings = self.settings
        if root is not None:
            settings = settings.model_copy(
                update={"checkpoint": settings.checkpoint.model_copy(update={"resume": True})}
            )
        try:
            self.trainer = ranked.build(settings, self.ranks)
        except Exception:
            log.exception("rebuilding the trainer failed: restart the learner (it resumes where this went)",
                          step=target, discarded=discarded)  # fmt: skip
            raise
        log.warning(
            "went back to an older checkpoint: the run's ledger lost the steps after it",
            step=self.trainer.step, was=previous, discarded=discarded,
        )  # fmt: skip
        return Restored(self.trainer.step, self.trainer.weight_version, self.trainer.last_batch_id, previous)

    # ------------------------------------------------------------------ publishing weights

    async def prepare_weights(
        self, kind: TransportKind, receivers: tuple[Receiver, ...], holders: list[Holder] | None = None
    ) -> tuple[Prepared, float]:
        """The current weights packed by transport `kind` (existing if already prepared) and the ms spent.
        `holders`: what every rollout the caller vouches for serves (None: it lists none), for the
        transports that must not overwrite what a rollout may still read (cuda_ipc's fence).

        Answers as soon as the version is described; a transport that pushes (a broadcast) then
        publishes it on the model thread in the same job, so no train step can change the weights
        between the description and the push.
        """
        trainer = self._ready()
        transport = transports.get(kind)
        loop = asyncio.get_running_loop()
        described: asyncio.Future[tuple[Prepared, float]] = loop.create_future()

        def prepare_and_publish() -> None:
            started = time.perf_counter()
            self._publish.state[HOLDERS_KEY] = holders  # this request's (prepares run one at a time)
            export = partial(trainer.export, snapshot=not transport.live_state)
            with trainer.on_idle_cores():  # copying the model: torch's copies run on its whole pool
                item, fresh = self.store.prepare(
                    trainer.weight_version, transport, export, self._publish, receivers
                )
            ms = (time.perf_counter() - started) * 1e3 if fresh else 0.0
            loop.call_soon_threadsafe(_resolve, described, (item, ms))
            if fresh:
                item.publish()

        job = loop.run_in_executor(self._executor, prepare_and_publish)
        await asyncio.wait({described, job}, return_when=asyncio.FIRST_COMPLETED)
        if not described.done():
            job.result()  # prepare raised: its error is the answer
        item, ms = described.result()
        job.add_done_callback(_log_publish_failure)
        log.info(
            "weights prepared",
            version=item.version,
            kind=kind,
            bytes=item.manifest.total_bytes,
            ms=round(ms, 1),
        )
        return item, ms

    async def fetch_chunks(
        self, version: int, buckets: list[int], base_version: int = 0
    ) -> AsyncIterator[bytes]:
        """Chunks of a prepared version (any transport's; deltas against `base_version` where it has
        them); yields to the loop between chunks."""
        item = self.store.get(version)
        if base_version:
            await delta_ready(item)  # encoded in the background after PrepareWeights
        for chunk in chunks(item, buckets, self.settings.publish.chunk_bytes, base_version):
            yield chunk
            await asyncio.sleep(0)

    async def release_weights(self, version: int) -> None:
        # off the loop (freeing a model-sized medium: munmap + unlink, CUDA IPC collection), and off
        # the model thread (no need to queue behind a train step); the store is thread-safe
        await asyncio.to_thread(self.store.release, version)
        log.info("weights released", version=version)

    @property
    def adapter(self) -> LoraSpec | None:
        """What the published versions are when they carry the LoRA adapter only (export_format
        adapter); None when they are the whole (merged) state_dict."""
        if self.settings.publish.export_format != "adapter":
            return None
        lora = self.settings.lora
        return LoraSpec(lora.rank, lora.alpha, tuple(lora.target_modules))

    def advertise_address(self) -> str:
        """host:port rollouts dial for FetchWeights."""
        if self.settings.publish.advertise_address:
            return self.settings.publish.advertise_address
        port = self.bound_port or self.settings.port
        if not port:
            raise FailedPrecondition(
                "learner address unknown: set --publish.advertise-address or a fixed --port"
            )
        host = socket.gethostname() if self.settings.host in _ANY_HOST else self.settings.host
        return f"{host}:{port}"

    # ------------------------------------------------------------------ state

    def metrics_snapshot(self) -> tuple[int, int, dict[str, float]] | None:
        """(step, weight version, last step's metrics) for /metrics; None while loading."""
        trainer = self.trainer
        if trainer is None:
            return None
        outcome = trainer.last_outcome
        return trainer.step, trainer.weight_version, dict(outcome.metrics) if outcome else {}

    def state(self) -> LearnerState:
        trainer = self._ready()
        return LearnerState(
            weight_version=trainer.weight_version,
            step=trainer.step,
            model=self.settings.model,
            loss=self.settings.loss.kind,
            prepared_versions=self.store.versions(),
            device=str(trainer.device),
            dtype=dtype_name(trainer.compute_dtype),
            last_batch_id=trainer.last_batch_id,
            lineage_id=trainer.lineage_id or self.run_id,
            instance_id=self.run_id,
            ranks=self.ranks.world if self.ranks else 1,
            sharded=self.ranks is not None,
        )
