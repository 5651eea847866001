"""The grpc_stream transport: the learner half packs and serves chunks, the rollout half streams them
from a real FetchWeights server into a segment it owns, verifies and cleans up."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo.learner.v1 import learner_pb2
from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound
from services.common.weights import iter_tensors
from services.transports import PublishContext, StageContext, TransportKind
from services.transports import registry as transports
from services.transports.chunk_wire import decode_chunk
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
    for wire in chunks(prepared, [], 100_000):
        chunk = learner_pb2.FetchWeightsResponse.FromString(wire).chunk  # protobuf reads what we wrote
        assert chunk.version == 7 and len(chunk.data) <= 100_000
        data[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
    assert data == prepared.view().tobytes()
    only_second = [decode_chunk(wire) for wire in chunks(prepared, [1], 1 << 20)]
    assert {chunk.bucket for chunk in only_second} == {1}
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


async def test_stage_streams_verified_bytes_into_an_owned_segment_reused_then_cleaned_up() -> None:
    transport = transports.get(TransportKind.grpc_stream)
    first, second = sample_state(0), sample_state(1)
    packed, packed2 = Packed(first), Packed(second)
    assert len(packed.manifest.buckets) > 1
    async with WeightsServer() as server:
        target = transports.target_from_proto(server.publish(1, packed))
        staged = await transport.stage(target, CTX)
        assert staged.plan.kind == TransportKind.shared_memory  # loads through the shared-memory half
        name = staged.plan.spec["segment_name"]
        _same(name, packed, first)
        staged.release()
        _same(name, packed, first)  # released: kept as the spare, pages and all
        # the next version is received into the spare: the same segment, now holding only version 2
        staged2 = await transport.stage(transports.target_from_proto(server.publish(2, packed2)), CTX)
        assert staged2.plan.spec["segment_name"] == name
        _same(name, packed2, second)
        staged2.release()
    transport.close()  # the rollout's shutdown: the spare goes
    with pytest.raises(FileNotFoundError):
        attach_segment(name)


async def test_a_stale_spare_never_passes_for_a_version() -> None:
    transport = transports.get(TransportKind.grpc_stream)
    packed = Packed(sample_state(0))
    async with WeightsServer() as server:
        (await transport.stage(transports.target_from_proto(server.publish(1, packed)), CTX)).release()
        # version 2's stream is corrupted in its first bucket: whatever the spare held, it is refused
        corrupt = transports.target_from_proto(server.publish(2, Packed(sample_state(2)), corrupt=True))
        with pytest.raises(DataLoss, match="bucket 0 checksum mismatch"):
            await transport.stage(corrupt, CTX)
    transport.close()


async def test_corruption_is_data_loss() -> None:
    packed = Packed(sample_state())
    async with WeightsServer() as server:
        target = transports.target_from_proto(server.publish(2, packed, corrupt=True))
        with pytest.raises(DataLoss, match="bucket 0 checksum mismatch"):
            await transports.get(target.kind).stage(target, CTX)


def _moved(chunk, **changes):
    moved = copy.deepcopy(chunk)
    for name, value in changes.items():
        setattr(moved, name, value)
    return moved


@pytest.mark.parametrize(
    "tamper, problem",
    [
        (lambda c: c[:-1], r"delivered \d+ of \d+ bytes \(bucket \d+ incomplete\)"),
        (lambda c: [*c, c[0]], "sent more than the .* bytes of bucket 0"),
        (lambda c: [_moved(c[0], bucket=1), *c[1:]], r"chunk \[0, \+\d+\) lies outside its bucket 1"),
        (lambda c: [_moved(c[0], bucket=99), *c[1:]], "lies outside its bucket 99"),
        (lambda c: [_moved(c[0], offset=1 << 40), *c[1:]], "lies outside its bucket 0"),
        (lambda c: [_moved(c[0], version=8), *c[1:]], "sent version 8, expected 7"),
    ],
    ids=["short", "duplicate", "wrong-bucket", "unknown-bucket", "offset-outside", "wrong-version"],
)
async def test_a_faulty_stream_is_data_loss_and_the_next_version_still_arrives(tamper, problem) -> None:
    transport = transports.get(TransportKind.grpc_stream)
    good = Packed(sample_state(1))
    async with WeightsServer() as server:
        bad = transports.target_from_proto(server.publish(7, Packed(sample_state(0)), tamper=tamper))
        with pytest.raises(DataLoss, match=problem):
            await transport.stage(bad, CTX)
        staged = await transport.stage(transports.target_from_proto(server.publish(8, good)), CTX)
        _same(staged.plan.spec["segment_name"], good, sample_state(1))
        staged.release()
    transport.close()


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
