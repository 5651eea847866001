"""grpc_stream's sparse deltas between a real learner service (bf16 export, small buckets) and the
rollout half: the first version arrives whole, the next as deltas over the spare segment's bytes,
rebuilt bit for bit (the bytes equal a whole fetch of the same version); a spare whose bytes are not the
advertised base (corrupted here) fails the rebuilt buckets' checksums, and the version is fetched whole
instead; a receiver without a base, or a learner with deltas off, moves whole versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.clients import open_channel
from services.common.serve import start_server
from services.learner.config import LearnerSettings
from services.learner.server import LearnerApp
from services.transports import StageContext
from services.transports import registry as transports
from services.transports.grpc_stream import GrpcStreamTransport
from services.transports.shared_memory import attach_segment
from tests.learner.test_learner_grpc import fetch_all, make_batch, vocab_of

TIMEOUT = 30.0
GRPC = types_pb2.WEIGHT_TRANSPORT_KIND_GRPC_STREAM
CTX = StageContext(rollout_id="delta-test", fetch_timeout_s=TIMEOUT)


@pytest.fixture
async def learner(tiny_model_dir: Path, request: pytest.FixtureRequest):
    """A learner service publishing bf16 in 64 KiB buckets (several per version); `delta` from the
    test's parameter (default on)."""
    publish = {"export_dtype": "bfloat16", "bucket_bytes": 64 << 10, "delta": getattr(request, "param", True)}
    settings = LearnerSettings.load(
        model=str(tiny_model_dir), device="cpu", port=0, optim={"lr": 1e-5}, publish=publish
    )
    app = LearnerApp(settings)
    running = await start_server(app, settings)
    channel = open_channel(running.address)
    try:
        yield learner_pb2_grpc.LearnerServiceStub(channel), vocab_of(tiny_model_dir)
    finally:
        await channel.close()
        await running.close()


async def _next_version(stub, vocab: int, step: int) -> types_pb2.WeightVersion:
    """Train one step, release the last prepared version, prepare the new one over grpc_stream."""
    await stub.TrainStep(
        learner_pb2.TrainStepRequest(batch=make_batch(vocab, step, f"b{step}")), timeout=TIMEOUT
    )
    if step:
        await stub.ReleaseWeights(learner_pb2.ReleaseWeightsRequest(version=step), timeout=TIMEOUT)
    prepared = await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=GRPC), timeout=TIMEOUT)
    return prepared.weight_version


def _segment_bytes(name: str, size: int) -> bytes:
    segment = attach_segment(name)
    try:
        return bytes(segment.buf[:size])
    finally:
        segment.close()


async def test_the_next_version_arrives_as_deltas_rebuilt_bit_for_bit(learner) -> None:
    stub, vocab = learner
    rollout = GrpcStreamTransport()
    try:
        first = await _next_version(stub, vocab, 0)
        assert first.delta_base_version == 0  # nothing packed before it
        staged = await rollout.stage(transports.target_from_proto(first), CTX)
        assert staged.received_bytes == first.total_bytes
        staged.release()  # committed: its segment is the spare, holding version 1

        for step in (1, 2):
            version = await _next_version(stub, vocab, step)
            assert version.delta_base_version == step and len(version.buckets) > 1
            staged = await rollout.stage(transports.target_from_proto(version), CTX)
            assert 0 < staged.received_bytes < version.total_bytes / 2  # only the deltas crossed
            rebuilt = _segment_bytes(staged.plan.spec["segment_name"], version.total_bytes)
            assert rebuilt == bytes(await fetch_all(stub, version))  # the same bytes as a whole fetch
            staged.release()
    finally:
        rollout.close()


async def test_a_spare_that_is_not_the_base_is_refused_and_the_version_fetched_whole(learner) -> None:
    stub, vocab = learner
    rollout = GrpcStreamTransport()
    try:
        staged = await rollout.stage(transports.target_from_proto(await _next_version(stub, vocab, 0)), CTX)
        name = staged.plan.spec["segment_name"]
        staged.release()
        version = await _next_version(stub, vocab, 1)
        segment = attach_segment(name)  # the base's bytes change under the rollout's record of them
        try:
            for bucket in version.buckets:
                size = min(4096, bucket.nbytes)
                segment.buf[bucket.offset : bucket.offset + size] = bytes(size)
        finally:
            segment.close()
        staged = await rollout.stage(transports.target_from_proto(version), CTX)
        # the delta up to its first refused bucket, then the version whole
        assert version.total_bytes < staged.received_bytes < 2 * version.total_bytes
        assert _segment_bytes(name, version.total_bytes) == bytes(await fetch_all(stub, version))
        staged.release()
    finally:
        rollout.close()


async def test_a_receiver_without_the_base_fetches_whole_and_a_foreign_base_is_refused(learner) -> None:
    stub, vocab = learner
    await _next_version(stub, vocab, 0)
    version = await _next_version(stub, vocab, 1)
    assert version.delta_base_version == 1
    newcomer = GrpcStreamTransport()  # a rollout that joined now: no spare
    try:
        staged = await newcomer.stage(transports.target_from_proto(version), CTX)
        assert staged.received_bytes == version.total_bytes
        staged.release()
    finally:
        newcomer.close()
    request = learner_pb2.FetchWeightsRequest(version=version.version, base_version=7)
    with pytest.raises(Exception) as caught:
        async for _ in stub.FetchWeights(request, timeout=TIMEOUT):
            pass
    assert caught.value.code().name == "FAILED_PRECONDITION"
    assert "no delta against version 7 (its base is 1)" in caught.value.details()


@pytest.mark.parametrize("learner", [False], indirect=True)
async def test_with_deltas_off_every_version_is_whole(learner) -> None:
    stub, vocab = learner
    await _next_version(stub, vocab, 0)
    version = await _next_version(stub, vocab, 1)
    assert (version.delta_base_version, version.delta_base_digest) == (0, "")
