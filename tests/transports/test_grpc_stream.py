"""The grpc_stream transport: the learner half packs and serves chunks, the rollout half streams them
from a real FetchWeights server into a segment it owns, verifies and cleans up."""

from __future__ import annotations

import pytest
import torch

from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from services.common.weights import iter_tensors
from services.transports import PublishContext, StageContext, TransportKind
from services.transports import registry as transports
from services.transports.grpc_stream import chunks
from services.transports.shared_memory import attach_segment

from .support import Packed, WeightsServer, sample_state

CTX = StageContext(rollout_id="test", fetch_timeout_s=30)


def _same(segment_name: str, packed: Packed, state: dict[str, torch.Tensor]) -> None:
    segment = attach_segment(segment_name)
    try:
        loaded = dict(iter_tensors(segment.buf, packed.manifest.tensors))
        for name, tensor in state.items():
            assert torch.equal(loaded[name], tensor), name
        del loaded
    finally:
        segment.close()


def test_learner_half_packs_describes_and_serves_chunks() -> None:
    state = sample_state()
    transport = transports.get(TransportKind.grpc_stream)
    ctx = PublishContext("run", 256 << 10, 1 << 20, lambda: "learner.example:50053")
    prepared = transport.prepare(7, state, ctx)
    message = transports.describe(prepared)
    assert (message.version, message.parent_version) == (7, 6)
    assert (
        message.grpc_stream.address == "learner.example:50053" and message.grpc_stream.chunk_bytes == 1 << 20
    )
    assert len(message.buckets) > 1
    data = bytearray(message.total_bytes)
    for _, offset, piece in chunks(prepared, [], 100_000):
        assert len(piece) <= 100_000
        data[offset : offset + len(piece)] = piece
    assert data == prepared.view().tobytes()
    only_second = list(chunks(prepared, [1], 1 << 20))
    assert {bucket for bucket, _, _ in only_second} == {1}
    with pytest.raises(InvalidArgument, match="no bucket 99"):
        list(chunks(prepared, [99], 1 << 20))
    prepared.close()
    with pytest.raises(NotFound, match="released"):
        prepared.view()


def test_learner_half_needs_an_address_before_packing() -> None:
    def unknown() -> str:
        raise FailedPrecondition("learner address unknown")

    with pytest.raises(FailedPrecondition, match="address unknown"):
        transports.get(TransportKind.grpc_stream).prepare(
            1, sample_state(), PublishContext("r", 1 << 20, 1 << 20, unknown)
        )


async def test_stage_streams_verified_bytes_into_an_owned_segment_and_cleans_up() -> None:
    state = sample_state()
    packed = Packed(state)
    assert len(packed.manifest.buckets) > 1
    async with WeightsServer() as server:
        target = transports.target_from_proto(server.publish(1, packed))
        staged = await transports.get(target.kind).stage(target, CTX)
        assert staged.plan.kind == TransportKind.shared_memory  # loads through the shared-memory half
        _same(staged.plan.spec["segment_name"], packed, state)
        staged.release()
    with pytest.raises(FileNotFoundError):
        attach_segment(staged.plan.spec["segment_name"])


async def test_corruption_is_data_loss_and_leaves_no_segment() -> None:
    packed = Packed(sample_state())
    async with WeightsServer() as server:
        target = transports.target_from_proto(server.publish(2, packed, corrupt=True))
        with pytest.raises(DataLoss, match="bucket 0 checksum mismatch"):
            await transports.get(target.kind).stage(target, CTX)


async def test_unknown_version_is_failed_precondition_and_dead_learner_unavailable() -> None:
    packed = Packed(sample_state())
    async with WeightsServer() as server:
        message = server.publish(3, packed)
        message.version = 4  # the learner never prepared v4
        with pytest.raises(FailedPrecondition, match="NOT_FOUND"):
            await transports.get(TransportKind.grpc_stream).stage(transports.target_from_proto(message), CTX)
    message.version = 3  # the server is gone now
    short = StageContext(rollout_id="test", fetch_timeout_s=2)
    with pytest.raises(Exception) as caught:
        await transports.get(TransportKind.grpc_stream).stage(transports.target_from_proto(message), short)
    assert caught.value.unreachable, caught.value
