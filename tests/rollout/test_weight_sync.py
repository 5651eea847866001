"""Weight staging without an engine: real shared memory, a real FetchWeights gRPC server, checksums."""

from __future__ import annotations

import uuid

import pytest
import torch

from services.common.errors import Aborted, DataLoss, FailedPrecondition, InvalidArgument
from services.common.weights import attach_segment, iter_tensors
from services.rollout.servicer import stage_target_from_proto
from services.rollout.weight_sync import StageTarget, UnsupportedSource, WeightStager

from .weights_support import Packed, WeightsServer


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 400, generator=generator),  # several 256 KiB buckets
        "b.bias": torch.randn(7, generator=generator).to(torch.bfloat16),
        "c.steps": torch.arange(5),
    }


def _same(segment_name: str, packed: Packed, state: dict[str, torch.Tensor]) -> None:
    segment = attach_segment(segment_name)
    try:
        loaded = dict(iter_tensors(segment.buf, packed.manifest.tensors))
        for name, tensor in state.items():
            assert torch.equal(loaded[name], tensor), name
        del loaded
    finally:
        segment.close()


async def test_grpc_stream_stages_verified_bytes_and_cleans_up() -> None:
    state = _state()
    packed = Packed(state)
    assert len(packed.manifest.buckets) > 1
    stager = WeightStager("test", fetch_timeout_s=30)
    async with WeightsServer() as server:
        target = stage_target_from_proto(server.publish(1, packed))
        staged = await stager.stage(target, current_version=0)
        assert stager.staged_version == 1
        assert staged.owned and staged.manifest.total_bytes == len(packed.data)
        _same(staged.segment_name, packed, state)
        again = await stager.stage(target, current_version=0)  # retried StageWeights: no refetch
        assert again is staged
        taken = await stager.take(1)
        assert stager.staged_version == -1
        taken.release()
    with pytest.raises(FileNotFoundError):
        attach_segment(staged.segment_name)


async def test_grpc_stream_corruption_is_data_loss() -> None:
    packed = Packed(_state())
    stager = WeightStager("test", fetch_timeout_s=30)
    async with WeightsServer() as server:
        target = stage_target_from_proto(server.publish(2, packed, corrupt=True))
        with pytest.raises(DataLoss, match="bucket 0 checksum mismatch"):
            await stager.stage(target, current_version=0)
    assert stager.staged_version == -1


async def test_grpc_stream_unknown_version_is_failed_precondition() -> None:
    packed = Packed(_state())
    stager = WeightStager("test", fetch_timeout_s=30)
    async with WeightsServer() as server:
        message = server.publish(3, packed)
        message.version = 4  # the learner never prepared v4
        with pytest.raises(FailedPrecondition, match="NOT_FOUND"):
            await stager.stage(stage_target_from_proto(message), current_version=0)


async def test_shared_memory_stage_checks_the_producer_segment() -> None:
    state = _state(1)
    packed = Packed(state)
    name = f"grpo_test_{uuid.uuid4().hex[:10]}"
    producer = packed.to_segment(name)
    try:
        message = packed.weight_version(5)
        message.shared_memory.segment_name = name
        message.shared_memory.size = len(packed.data)
        stager = WeightStager("test", fetch_timeout_s=30)
        staged = await stager.stage(stage_target_from_proto(message), current_version=4)
        assert not staged.owned and staged.segment_name == name
        _same(name, packed, state)
        assert await stager.abort(5)
        assert not await stager.abort(5)
        _same(name, packed, state)  # the producer's segment survives our release
        producer.buf[10] ^= 0xFF
        with pytest.raises(DataLoss, match="bucket 0"):
            await stager.stage(stage_target_from_proto(message), current_version=4)
    finally:
        producer.close()
        producer.unlink()


async def test_missing_segment_is_failed_precondition() -> None:
    packed = Packed(_state())
    message = packed.weight_version(1)
    message.shared_memory.segment_name = f"grpo_missing_{uuid.uuid4().hex[:8]}"
    with pytest.raises(FailedPrecondition, match="does not exist"):
        await WeightStager("t", 30).stage(stage_target_from_proto(message), current_version=0)


async def test_version_rules_and_unsupported_transports() -> None:
    packed = Packed(_state())
    stager = WeightStager("t", 30)
    for kind in ("cuda_ipc", "nccl"):
        target = StageTarget(3, packed.manifest, UnsupportedSource(kind))
        with pytest.raises(FailedPrecondition, match=f"{kind} weight transport is not implemented yet"):
            await stager.stage(target, current_version=0)
    with pytest.raises(Aborted, match="not newer"):
        await stager.stage(StageTarget(3, packed.manifest, UnsupportedSource("nccl")), current_version=3)
    with pytest.raises(FailedPrecondition, match="not staged"):
        await stager.take(3)


def test_proto_translation_rejects_bad_manifests_and_missing_transport() -> None:
    packed = Packed(_state())
    message = packed.weight_version(1)
    with pytest.raises(InvalidArgument, match="no transport"):
        stage_target_from_proto(message)
    message.cuda_ipc.SetInParent()
    assert stage_target_from_proto(message).source == UnsupportedSource("cuda_ipc")
    message.total_bytes += 1
    with pytest.raises(InvalidArgument, match="total_bytes"):
        stage_target_from_proto(message)
