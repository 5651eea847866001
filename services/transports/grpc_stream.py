"""`grpc_stream`: the learner's `FetchWeights` server stream of ≤ 1 MiB chunks (works anywhere).

learner   packs the model's tensors into process memory; FetchWeights serves slices of it (`chunks`), each
          written straight into protobuf wire bytes (`chunk_wire.encode_chunk`: one copy)
rollout   streams every chunk (one deadline for the whole fetch) straight into a shared-memory
          segment it creates (`chunk_wire.decode_chunk`: a view, then the one copy into the segment),
          checks sizes and offsets, verifies every bucket checksum as its bytes land (`landing_check`)
engine    loads from that segment through the shared_memory engine half (one load path)

The receive segment of a released version is kept (one spare) and the next version is received into
it: writing a fresh segment faults in every one of its pages (a zeroed 4 KiB page per fault), which
profiled as most of a stage on the 221 MiB benchmark model. Stale bytes cannot survive into a version:
every byte is received again, and every bucket's checksum is verified over the segment.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common import validation as check
from services.common import weights
from services.common.clients import GrpcClient
from services.common.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    GrpoError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from services.transports.base import (
    Prepared,
    PublishContext,
    Receiver,
    StageContext,
    Staged,
    StageTarget,
    TransportKind,
    WeightTransport,
)
from services.transports.chunk_wire import FETCH_PATH, ChunkView, decode_chunk, encode_chunk
from services.transports.landing_check import LandingCheck
from services.transports.shared_memory import (
    SegmentStaged,
    create_segment,
    rollout_segment_name,
    unlink_segment,
)


@dataclass(frozen=True)
class GrpcStreamDescriptor:
    address: str  # host:port of the learner serving FetchWeights
    chunk_bytes: int


class InMemoryPrepared(Prepared):
    kind = TransportKind.grpc_stream

    def __init__(self, version: int, manifest: weights.Manifest, buffer: bytearray, address: str, chunk: int):
        super().__init__(version, manifest)
        self.buffer: bytearray | None = buffer
        self.address = address
        self.chunk_bytes = chunk

    def view(self) -> memoryview:
        if self.buffer is None:
            raise NotFound(f"weight version {self.version} was released")
        return memoryview(self.buffer)

    def close(self) -> None:
        self.buffer = None


def chunks(prepared: Prepared, buckets: list[int], chunk_bytes: int) -> Iterator[bytes]:
    """The serialized `FetchWeightsResponse` of every ≤ chunk_bytes slice of a prepared version (empty
    `buckets` = all). No view of the version's buffer outlives a step of the iteration, so a release
    (which may unmap it) never finds it exported."""
    by_index = {b.index: b for b in prepared.manifest.buckets}
    unknown = [b for b in buckets if b not in by_index]
    if unknown:
        raise InvalidArgument(
            f"weight version {prepared.version} has no bucket {unknown[0]} (has {len(by_index)})"
        )
    selected = [by_index[b] for b in buckets] if buckets else list(prepared.manifest.buckets)
    for bucket, offset, size in weights.chunk_ranges(selected, chunk_bytes):
        with prepared.view() as view, view[offset : offset + size] as piece:
            message = encode_chunk(prepared.version, bucket, offset, piece)
        yield message


class _Fetcher(GrpcClient[learner_pb2_grpc.LearnerServiceStub]):
    @property
    def peer(self) -> str:
        return f"learner {self.address}"


class _ReceiveSegments:
    """This process's receive segments: a released one is kept as the spare for the next version."""

    def __init__(self) -> None:
        self._spare: shared_memory.SharedMemory | None = None
        self._lock = threading.Lock()

    def take(self, rollout_id: str, size: int) -> shared_memory.SharedMemory:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            if spare.size == max(size, 1):
                return spare
            unlink_segment(spare)  # the model changed shape
        return create_segment(rollout_segment_name(rollout_id), size)

    def give_back(self, segment: shared_memory.SharedMemory) -> None:
        with self._lock:
            old, self._spare = self._spare, segment
        if old is not None:
            unlink_segment(old)

    def clear(self) -> None:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            unlink_segment(spare)


class ReceivedStaged(SegmentStaged):
    """A version received into one of our segments; released, the segment becomes the spare."""

    def __init__(self, segments: _ReceiveSegments, *args: Any) -> None:
        super().__init__(*args)
        self._segments = segments

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._segments.give_back(self.segment)


def _fetch_failed(exc: GrpoError, version: int) -> GrpoError:
    """The StageWeights error for a failed fetch: a version the learner no longer has (or never had)
    is the caller's precondition, a slow or absent learner is a deadline/availability problem."""
    message = f"FetchWeights v{version} failed: {exc}"
    if isinstance(exc, NotFound | FailedPrecondition | InvalidArgument):
        return FailedPrecondition(message)
    if isinstance(exc, DeadlineExceeded | DataLoss):
        return type(exc)(message)
    return Unavailable(message)


class _Fetchers:
    """The channel to the learner, kept across versions (the last address only): a new connection
    starts with a small HTTP/2 flow-control window that grows during the stream, which cost ~30 % of a
    221 MiB fetch on loopback. A grpc.aio channel belongs to its event loop, so it is kept per loop."""

    def __init__(self) -> None:
        self._current: tuple[str, asyncio.AbstractEventLoop, _Fetcher] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def get(self, address: str) -> _Fetcher:
        loop = asyncio.get_running_loop()
        current = self._current
        if current is not None and current[0] == address and current[1] is loop:
            return current[2]
        self.close()
        fetcher = _Fetcher(address, learner_pb2_grpc.LearnerServiceStub)
        self._current = (address, loop, fetcher)
        return fetcher

    def close(self) -> None:
        """Drop the channel; closed on its loop when that loop still runs (else it died with it)."""
        current, self._current = self._current, None
        if current is None or current[1].is_closed():
            return
        _, loop, fetcher = current

        def close_on_loop() -> None:
            task = loop.create_task(fetcher.close())
            self._closing.add(task)  # referenced until done (the loop keeps only weak references)
            task.add_done_callback(self._closing.discard)

        loop.call_soon_threadsafe(close_on_loop)


async def _fetch(fetcher: _Fetcher, version: int, timeout: float) -> AsyncIterator[ChunkView]:  # noqa: ASYNC109
    """The chunks of `version` from the learner, under one deadline for the whole stream."""
    stream = fetcher.stream(FETCH_PATH, learner_pb2.FetchWeightsRequest(version=version), timeout, raw=True)
    while True:
        try:
            response = await anext(stream)
        except StopAsyncIteration:
            return
        except GrpoError as exc:
            raise _fetch_failed(exc, version) from exc
        yield decode_chunk(response)


def _when_done(futures: list[asyncio.Future[None]], action: Callable[[], None]) -> None:
    """Run `action` once every future is done (now if they are), whatever their outcomes."""
    running = [f for f in futures if not f.done()]
    for future in futures:
        if future.done() and not future.cancelled():
            future.exception()  # retrieved: a failed check behind our error is not "never retrieved"
    if not running:
        action()
        return
    asyncio.gather(*running, return_exceptions=True).add_done_callback(lambda _: action())


class GrpcStreamTransport(WeightTransport):
    kind = TransportKind.grpc_stream
    live_state = True  # `prepare` packs every tensor into its buffer before it returns: no snapshot

    def __init__(self) -> None:
        self._segments = _ReceiveSegments()
        self._fetchers = _Fetchers()

    def close(self) -> None:
        self._segments.clear()
        self._fetchers.close()

    # ---- learner half
    def prepare(
        self,
        version: int,
        state: Mapping[str, torch.Tensor],
        ctx: PublishContext,
        receivers: tuple[Receiver, ...] = (),
    ) -> Prepared:
        address = ctx.advertise_address()  # fail before the expensive pack if no address is known
        buffer = bytearray(weights.packed_size(weights.plan_layout(state)))
        manifest = weights.build_manifest(state, memoryview(buffer), ctx.bucket_bytes)
        return InMemoryPrepared(version, manifest, buffer, address, ctx.chunk_bytes)

    def write_descriptor(self, prepared: Prepared, message: types_pb2.WeightVersion) -> None:
        assert isinstance(prepared, InMemoryPrepared)
        message.grpc_stream.address = prepared.address
        message.grpc_stream.chunk_bytes = prepared.chunk_bytes

    # ---- rollout half
    def read_descriptor(self, message: types_pb2.WeightVersion) -> GrpcStreamDescriptor:
        check.address(message.grpc_stream.address, "weight_version.grpc_stream.address")
        return GrpcStreamDescriptor(message.grpc_stream.address, message.grpc_stream.chunk_bytes)

    async def stage(self, target: StageTarget, ctx: StageContext) -> Staged:
        """Stream every chunk of `target` into a receive segment, hashing each chunk (in a thread,
        while the next ones stream) right after its copy (`landing_check`)."""
        started = time.perf_counter()
        manifest = target.manifest
        buckets = {b.index: b for b in manifest.buckets}
        missing = {b.index: b.nbytes for b in manifest.buckets}  # bytes still to come, per bucket
        segment = self._segments.take(ctx.rollout_id, manifest.total_bytes)
        verifier = LandingCheck(segment.buf, manifest)
        try:
            fetcher = self._fetchers.get(target.descriptor.address)
            async for chunk in _fetch(fetcher, target.version, ctx.fetch_timeout_s):
                size, bucket = len(chunk.data), buckets.get(chunk.bucket)
                if chunk.version != target.version:
                    raise DataLoss(f"FetchWeights sent version {chunk.version}, expected {target.version}")
                if bucket is None or not (
                    bucket.offset <= chunk.offset and chunk.offset + size <= bucket.offset + bucket.nbytes
                ):
                    raise DataLoss(
                        f"FetchWeights chunk [{chunk.offset}, +{size}) lies outside its bucket {chunk.bucket}"
                    )
                segment.buf[chunk.offset : chunk.offset + size] = chunk.data
                missing[bucket.index] -= size
                if missing[bucket.index] < 0:
                    raise DataLoss(
                        f"FetchWeights sent more than the {bucket.nbytes} bytes of bucket {bucket.index}"
                    )
                verifier.landed(bucket, chunk.offset, size, complete=missing[bucket.index] == 0)
            short = {index: left for index, left in missing.items() if left}
            if short:
                got = manifest.total_bytes - sum(short.values())
                raise DataLoss(
                    f"FetchWeights v{target.version} delivered {got} of {manifest.total_bytes} bytes "
                    f"(bucket {min(short)} incomplete)"
                )
            await verifier.finish()
        except BaseException:
            # its bytes are garbage, its pages are not: the spare, once no check reads it any more
            _when_done(verifier.stop(), lambda: self._segments.give_back(segment))
            raise
        fetch_ms = (time.perf_counter() - started) * 1e3
        return ReceivedStaged(self._segments, target.version, target.manifest, segment, True, fetch_ms)
