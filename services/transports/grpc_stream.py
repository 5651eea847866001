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

Sparse deltas (bf16/fp16 weights, `publish.delta`): the learner keeps the last version it packed and
encodes each bucket of the next one against it (`weight_delta`), advertising the base in the
WeightVersion. A rollout whose spare segment holds exactly that base (its version and its bucket
digests) asks for the delta (`FetchWeightsRequest.base_version`); the learner sends each bucket as a
delta or whole, whichever is smaller, and the rollout rebuilds every delta bucket in place over the base
and verifies it against the new version's checksum like any received bucket. A rebuilt bucket that does
not match (a wrong base) fails the delta, and the version is fetched again whole into the same segment.
A new rollout, one that holds another version, or a failed stage fetches whole.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import torch

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common import validation as check
from services.common import weight_delta, weights
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
from services.common.logging import get_logger
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

log = get_logger(__name__)

_LAST_PACKED = "grpc_stream.last_packed"  # PublishContext.state: the base of the next version's delta
# encodes each version's delta off the learner's model thread (one version after another)
_ENCODER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-delta")


@dataclass(frozen=True)
class GrpcStreamDescriptor:
    address: str  # host:port of the learner serving FetchWeights
    chunk_bytes: int
    delta_base_version: int = 0  # FetchWeights can send deltas against this version (0: it cannot)
    delta_base_digest: str = ""  # weight_delta.base_digest of that version's manifest


@dataclass(frozen=True)
class VersionDelta:
    """A packed version's buckets encoded against the version packed before it (which
    `InMemoryPrepared.delta_base` names)."""

    buckets: tuple[weight_delta.Delta, ...]  # in manifest order

    @property
    def payload_bytes(self) -> int:
        return sum(len(d.payload) for d in self.buckets)


@dataclass(frozen=True)
class _Packed:
    version: int
    buffer: bytearray
    manifest: weights.Manifest


class InMemoryPrepared(Prepared):
    kind = TransportKind.grpc_stream

    def __init__(
        self,
        version: int,
        manifest: weights.Manifest,
        buffer: bytearray,
        address: str,
        chunk: int,
        delta_base: tuple[int, str] | None = None,
        delta: Future[VersionDelta] | None = None,
    ) -> None:
        super().__init__(version, manifest)
        self.buffer: bytearray | None = buffer
        self.address = address
        self.chunk_bytes = chunk
        self.delta_base = delta_base  # (version, base_digest) the delta is against
        self.delta = delta  # being encoded in the background (`_ENCODER`)

    def view(self) -> memoryview:
        if self.buffer is None:
            raise NotFound(f"weight version {self.version} was released")
        return memoryview(self.buffer)

    def close(self) -> None:
        self.buffer = None
        self.delta = None


def chunks(
    prepared: Prepared, buckets: list[int], chunk_bytes: int, base_version: int = 0
) -> Iterator[bytes]:
    """The serialized `FetchWeightsResponse` of every ≤ chunk_bytes slice of a prepared version (empty
    `buckets` = all). With `base_version` its delta's base: each bucket whose delta is smaller than the
    bucket comes as slices of that delta (at least one, empty for an unchanged bucket), the others whole.
    No view of the version's buffer outlives a step of the iteration, so a release (which may unmap it)
    never finds it exported."""
    by_index = {b.index: b for b in prepared.manifest.buckets}
    unknown = [b for b in buckets if b not in by_index]
    if unknown:
        raise InvalidArgument(
            f"weight version {prepared.version} has no bucket {unknown[0]} (has {len(by_index)})"
        )
    selected = [by_index[b] for b in buckets] if buckets else list(prepared.manifest.buckets)
    # only this transport's versions can be fetched as deltas (an nccl version's are broadcast)
    delta_base = prepared.delta_base if isinstance(prepared, InMemoryPrepared) else None
    if base_version and (delta_base is None or delta_base[0] != base_version):
        raise FailedPrecondition(
            f"weight version {prepared.version} has no delta against version {base_version}"
            + (f" (its base is {delta_base[0]})" if delta_base else "")
        )
    future = prepared.delta if isinstance(prepared, InMemoryPrepared) else None
    delta = future.result() if base_version and future is not None else None  # await `delta_ready` first
    if base_version and delta is None:
        raise NotFound(f"weight version {prepared.version} was released")
    for entry in selected:
        encoded = delta.buckets[entry.index] if delta is not None else None
        if encoded is None or encoded.encoding == weight_delta.Encoding.FULL:
            for bucket, offset, size in weights.chunk_ranges([entry], chunk_bytes):
                with prepared.view() as view, view[offset : offset + size] as piece:
                    message = encode_chunk(prepared.version, bucket, offset, piece)
                yield message
            continue
        payload, total = memoryview(encoded.payload), len(encoded.payload)
        for start in range(0, max(total, 1), chunk_bytes):
            piece = payload[start : start + chunk_bytes]
            yield encode_chunk(prepared.version, entry.index, start, piece, int(encoded.encoding), total)


async def delta_ready(prepared: Prepared) -> None:
    """Wait (off the loop) until a prepared version's delta is encoded, if it has one coming."""
    future = getattr(prepared, "delta", None)
    if future is not None:
        await asyncio.wrap_future(future)


def _same_layout(base: _Packed | None, manifest: weights.Manifest) -> bool:
    """Whether `manifest` can be encoded against `base`: the same tensors in the same buckets."""
    if base is None or base.manifest.tensors != manifest.tensors:
        return False
    return [(b.offset, b.nbytes) for b in base.manifest.buckets] == [
        (b.offset, b.nbytes) for b in manifest.buckets
    ]


def _encode_delta(base: _Packed, version: int, buffer: bytearray, manifest: weights.Manifest) -> VersionDelta:
    """`manifest`'s buckets (bytes in `buffer`) encoded against `base` (in `_ENCODER`'s thread)."""
    started = time.perf_counter()
    word = weight_delta.DELTA_WORD
    old, new = memoryview(base.buffer), memoryview(buffer)
    encoded = tuple(
        weight_delta.encode(old[b.offset : b.offset + b.nbytes], new[b.offset : b.offset + b.nbytes], word)
        for b in manifest.buckets
    )
    delta = VersionDelta(encoded)
    log.info(
        "weight delta encoded",
        version=version,
        base_version=base.version,
        bytes=delta.payload_bytes,
        whole_bytes=manifest.total_bytes,
        ms=round((time.perf_counter() - started) * 1e3, 1),
    )
    return delta


class _Fetcher(GrpcClient[learner_pb2_grpc.LearnerServiceStub]):
    @property
    def peer(self) -> str:
        return f"learner {self.address}"


@dataclass(frozen=True)
class _Holds:
    """The version whose verified bytes a spare segment still holds (a delta's base)."""

    version: int
    manifest: weights.Manifest


class _ReceiveSegments:
    """This process's receive segments: a released one is kept as the spare for the next version,
    with the version its bytes are when they are one whole."""

    def __init__(self) -> None:
        self._spare: tuple[shared_memory.SharedMemory, _Holds | None] | None = None
        self._lock = threading.Lock()

    def take(self, rollout_id: str, size: int) -> tuple[shared_memory.SharedMemory, _Holds | None]:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            if spare[0].size == max(size, 1):
                return spare
            unlink_segment(spare[0])  # the model changed shape
        return create_segment(rollout_segment_name(rollout_id), size), None

    def give_back(self, segment: shared_memory.SharedMemory, holds: _Holds | None = None) -> None:
        with self._lock:
            old, self._spare = self._spare, (segment, holds)
        if old is not None:
            unlink_segment(old[0])

    def clear(self) -> None:
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None:
            unlink_segment(spare[0])


class ReceivedStaged(SegmentStaged):
    """A version received into one of our segments; released, the segment becomes the spare (still
    holding this version's bytes: the base of the next version's delta)."""

    def __init__(self, segments: _ReceiveSegments, *args: Any, received_bytes: int) -> None:
        super().__init__(*args)
        self._segments = segments
        self.received_bytes = received_bytes

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._segments.give_back(self.segment, _Holds(self.version, self.manifest))


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


async def _fetch(
    fetcher: _Fetcher,
    version: int,
    timeout: float,  # noqa: ASYNC109
    base_version: int = 0,
) -> AsyncIterator[ChunkView]:
    """The chunks of `version` from the learner (deltas against `base_version` where it has them),
    under one deadline for the whole stream."""
    request = learner_pb2.FetchWeightsRequest(version=version, base_version=base_version)
    stream = fetcher.stream(FETCH_PATH, request, timeout, raw=True)
    while True:
        try:
            response = await anext(stream)
        except StopAsyncIteration:
            return
        except GrpoError as exc:
            raise _fetch_failed(exc, version) from exc
        yield decode_chunk(response)


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
        delta_base, delta = None, None
        if ctx.delta and weight_delta.delta_word(manifest):
            base = ctx.state.get(_LAST_PACKED)
            if _same_layout(base, manifest):
                delta_base = (base.version, weight_delta.base_digest(base.manifest))
                delta = _ENCODER.submit(_encode_delta, base, version, buffer, manifest)
            ctx.state[_LAST_PACKED] = _Packed(version, buffer, manifest)  # the next version's base
        else:
            ctx.state.pop(_LAST_PACKED, None)
        return InMemoryPrepared(version, manifest, buffer, address, ctx.chunk_bytes, delta_base, delta)

    def write_descriptor(self, prepared: Prepared, message: types_pb2.WeightVersion) -> None:
        assert isinstance(prepared, InMemoryPrepared)
        message.grpc_stream.address = prepared.address
        message.grpc_stream.chunk_bytes = prepared.chunk_bytes
        if prepared.delta_base is not None:
            message.delta_base_version, message.delta_base_digest = prepared.delta_base

    # ---- rollout half
    def read_descriptor(self, message: types_pb2.WeightVersion) -> GrpcStreamDescriptor:
        check.address(message.grpc_stream.address, "weight_version.grpc_stream.address")
        return GrpcStreamDescriptor(
            message.grpc_stream.address,
            message.grpc_stream.chunk_bytes,
            message.delta_base_version,
            message.delta_base_digest,
        )

    async def stage(self, target: StageTarget, ctx: StageContext) -> Staged:
        """Stream every chunk of `target` into a receive segment, hashing each chunk (in a thread,
        while the next ones stream) right after its copy (`landing_check`); as deltas over the spare
        segment's bytes when it holds the version the learner encoded them against."""
        started = time.perf_counter()
        manifest = target.manifest
        segment, holds = self._segments.take(ctx.rollout_id, manifest.total_bytes)
        base = _delta_base(target, holds)
        received = [0]  # bytes that arrived, the failed delta's included
        try:
            if base:
                try:
                    await self._receive(target, ctx, segment, base, received)
                except DataLoss as exc:  # a wrong base, or a corrupt delta: fetch it whole instead
                    log.warning(
                        "weight delta refused; fetching whole", version=target.version, error=str(exc)
                    )
                    base = 0
            if not base:
                await self._receive(target, ctx, segment, 0, received)
        except BaseException:
            # its bytes are garbage, its pages are not: the spare (the verification is done by now)
            self._segments.give_back(segment)
            raise
        fetch_ms = (time.perf_counter() - started) * 1e3
        return ReceivedStaged(
            self._segments, target.version, manifest, segment, True, fetch_ms, received_bytes=received[0]
        )

    async def _receive(
        self,
        target: StageTarget,
        ctx: StageContext,
        segment: shared_memory.SharedMemory,
        base_version: int,
        received: list[int],
    ) -> None:
        """Fetch `target` into `segment` (deltas against its bytes, version `base_version`, where the
        learner sends them) and verify every bucket, adding the bytes that arrive to `received[0]`.
        Once it returns or raises, nothing reads or writes the segment any more."""
        manifest = target.manifest
        buckets = {b.index: b for b in manifest.buckets}
        missing = {b.index: b.nbytes for b in manifest.buckets}  # bytes still to come, per bucket
        deltas: dict[int, bytearray] = {}  # bucket → its delta payload so far
        verifier = LandingCheck(segment.buf, manifest)
        try:
            fetcher = self._fetchers.get(target.descriptor.address)
            async for chunk in _fetch(fetcher, target.version, ctx.fetch_timeout_s, base_version):
                size, bucket = len(chunk.data), buckets.get(chunk.bucket)
                received[0] += size
                if chunk.version != target.version:
                    raise DataLoss(f"FetchWeights sent version {chunk.version}, expected {target.version}")
                if chunk.encoding:
                    if not base_version or bucket is None:
                        raise DataLoss(f"FetchWeights sent a delta of bucket {chunk.bucket} unasked")
                    if await self._delta_landed(segment, verifier, bucket, chunk, deltas, missing):
                        missing[bucket.index] = 0
                    continue
                if (
                    bucket is None
                    or bucket.index in deltas
                    or not (
                        bucket.offset <= chunk.offset and chunk.offset + size <= bucket.offset + bucket.nbytes
                    )
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
            # done reading the segment before it is written again (the whole fetch after a failed delta)
            await asyncio.shield(asyncio.gather(*verifier.stop(), return_exceptions=True))
            raise

    @staticmethod
    async def _delta_landed(
        segment: shared_memory.SharedMemory,
        verifier: LandingCheck,
        bucket: weights.BucketEntry,
        chunk: ChunkView,
        deltas: dict[int, bytearray],
        missing: dict[int, int],
    ) -> bool:
        """Collect a delta chunk; once its bucket's payload is whole, rebuild the bucket over the base
        bytes (in a thread) and hand it to the verifier. Returns whether the bucket is complete."""
        if missing[bucket.index] != bucket.nbytes:
            raise DataLoss(f"FetchWeights sent bucket {bucket.index} both whole and as a delta")
        payload = deltas.setdefault(bucket.index, bytearray())
        if chunk.offset != len(payload) or chunk.offset + len(chunk.data) > chunk.payload_bytes:
            raise DataLoss(
                f"FetchWeights delta chunk [{chunk.offset}, +{len(chunk.data)}) of bucket {bucket.index} "
                f"does not follow its {len(payload)} bytes of a {chunk.payload_bytes}-byte payload"
            )
        payload += chunk.data
        if len(payload) < chunk.payload_bytes:
            return False
        delta = weight_delta.Delta(weight_delta.Encoding(chunk.encoding), deltas.pop(bucket.index), 0)
        word = weight_delta.DELTA_WORD
        target = segment.buf[bucket.offset : bucket.offset + bucket.nbytes]
        await asyncio.to_thread(weight_delta.apply, target, delta, word)
        verifier.landed(bucket, bucket.offset, bucket.nbytes, complete=True)  # the rebuilt bucket's checksum
        return True


def _delta_base(target: StageTarget, holds: _Holds | None) -> int:
    """The version to ask deltas against: the one the spare segment holds, when it is the learner's
    base for `target` (same version, same bytes by digest, same layout); else 0 (fetch whole)."""
    descriptor = target.descriptor
    if not descriptor.delta_base_version or holds is None or holds.version != descriptor.delta_base_version:
        return 0
    if weight_delta.delta_word(target.manifest) is None or holds.manifest.tensors != target.manifest.tensors:
        return 0
    if weight_delta.base_digest(holds.manifest) != descriptor.delta_base_digest:
        return 0
    return holds.version
