"""`grpc_stream`: the learner's `FetchWeights` server stream of ≤ 1 MiB chunks (works anywhere).

learner   packs the snapshot into process memory; FetchWeights serves slices of it (`chunks`)
rollout   streams every chunk (one deadline for the whole fetch) straight into a shared-memory
          segment it creates, checks sizes and offsets, verifies every bucket checksum
engine    loads from that segment through the shared_memory engine half (one load path)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass

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
from services.transports.shared_memory import SegmentStaged, create_segment, unlink_segment, verify


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


def chunks(prepared: Prepared, buckets: list[int], chunk_bytes: int) -> Iterator[tuple[int, int, bytes]]:
    """(bucket, offset, bytes) slices of ≤ chunk_bytes of a prepared version (empty `buckets` = all)."""
    by_index = {b.index: b for b in prepared.manifest.buckets}
    unknown = [b for b in buckets if b not in by_index]
    if unknown:
        raise InvalidArgument(
            f"weight version {prepared.version} has no bucket {unknown[0]} (has {len(by_index)})"
        )
    selected = [by_index[b] for b in buckets] if buckets else list(prepared.manifest.buckets)
    for bucket, offset, size in weights.chunk_ranges(selected, chunk_bytes):
        yield bucket, offset, bytes(prepared.view()[offset : offset + size])


class _Fetcher(GrpcClient[learner_pb2_grpc.LearnerServiceStub]):
    @property
    def peer(self) -> str:
        return f"learner {self.address}"


def _segment_name(rollout_id: str, version: int) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in rollout_id)[:40]
    return f"grpo_rollout_{safe}_v{version}_{uuid.uuid4().hex[:12]}"


def _fetch_failed(exc: GrpoError, version: int) -> GrpoError:
    """The StageWeights error for a failed fetch: a version the learner no longer has (or never had)
    is the caller's precondition, a slow or absent learner is a deadline/availability problem."""
    message = f"FetchWeights v{version} failed: {exc}"
    if isinstance(exc, NotFound | FailedPrecondition | InvalidArgument):
        return FailedPrecondition(message)
    if isinstance(exc, DeadlineExceeded | DataLoss):
        return type(exc)(message)
    return Unavailable(message)


async def _fetch(address: str, version: int, timeout: float) -> AsyncIterator[types_pb2.WeightChunk]:  # noqa: ASYNC109
    """The chunks of `version` from the learner at `address`, under one deadline for the whole stream."""
    fetcher = _Fetcher(address, learner_pb2_grpc.LearnerServiceStub)
    try:
        stream = fetcher.stream("FetchWeights", learner_pb2.FetchWeightsRequest(version=version), timeout)
        while True:
            try:
                response = await anext(stream)
            except StopAsyncIteration:
                return
            except GrpoError as exc:
                raise _fetch_failed(exc, version) from exc
            yield response.chunk
    finally:
        await fetcher.close()


class GrpcStreamTransport(WeightTransport):
    kind = TransportKind.grpc_stream

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
        """Stream every chunk of `target` into a fresh segment and verify it."""
        started = time.perf_counter()
        total = target.manifest.total_bytes
        segment = create_segment(_segment_name(ctx.rollout_id, target.version), total)
        received = 0
        try:
            async for chunk in _fetch(target.descriptor.address, target.version, ctx.fetch_timeout_s):
                size = len(chunk.data)
                if chunk.version != target.version:
                    raise DataLoss(f"FetchWeights sent version {chunk.version}, expected {target.version}")
                if chunk.offset + size > total:
                    raise DataLoss(f"FetchWeights chunk [{chunk.offset}, +{size}) lies outside {total} bytes")
                segment.buf[chunk.offset : chunk.offset + size] = chunk.data
                received += size
            if received != total:
                raise DataLoss(f"FetchWeights v{target.version} delivered {received} of {total} bytes")
            await verify(segment, target.manifest)
        except BaseException:
            unlink_segment(segment)
            raise
        return SegmentStaged(
            target.version, target.manifest, segment, True, (time.perf_counter() - started) * 1e3
        )
