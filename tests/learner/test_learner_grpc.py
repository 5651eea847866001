"""LearnerService through a real in-process gRPC server on the tiny model."""

from __future__ import annotations

import json
from multiprocessing import shared_memory
from pathlib import Path

import grpc
import pytest
import torch

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common import weights
from services.common.clients import open_channel
from services.common.serve import start_server
from services.learner.config import LearnerSettings
from services.learner.server import LearnerApp
from services.learner.trainer import Trainer
from services.transports.shared_memory import attach_segment

TIMEOUT = 30.0
GRPC = types_pb2.WEIGHT_TRANSPORT_KIND_GRPC_STREAM
SHM = types_pb2.WEIGHT_TRANSPORT_KIND_SHARED_MEMORY


def vocab_of(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture
async def learner(model_dir, tmp_path):
    """(stub, learner) for a learner service on port 0; closed after the test."""
    settings = LearnerSettings.load(
        model=str(model_dir),
        device="cpu",
        port=0,
        optim={"lr": 1e-3},
        publish={"max_prepared_versions": 2, "collective_timeout_s": 2},
        checkpoint={"dir": tmp_path / "ckpt"},
        grace_seconds=1.0,
    )
    app = LearnerApp(settings)
    running = await start_server(app, settings)
    assert app.learner.bound_port == running.port
    channel = open_channel(running.address)
    try:
        yield learner_pb2_grpc.LearnerServiceStub(channel), app.learner
    finally:
        await channel.close()
        await running.close()


def make_batch(
    vocab: int, step: int = 0, batch_id: str = "b0", groups: int = 2, n: int = 3
) -> types_pb2.TrainBatch:
    batch = types_pb2.TrainBatch(batch_id=batch_id, step=step)
    for g in range(groups):
        group = batch.groups.add(group_id=f"g{g}")
        for i in range(n):
            length = 2 + (i + g) % 3
            group.completions.add(
                prompt_id=f"p{g}",
                index=i,
                prompt_token_ids=[(7 * g + j) % vocab for j in range(4)],
                completion_token_ids=[(3 * i + 5 * j + 1) % vocab for j in range(length)],
                logprobs=[-5.0] * length,
                sampling_params=types_pb2.SamplingParams(temperature=1.0, n=n),
            )
        group.rewards.extend([float(i % 2) for i in range(n)])
        group.advantages.extend([1.0 if i % 2 else -1.0 for i in range(n)])
    return batch


async def fetch_all(stub, wv: types_pb2.WeightVersion) -> bytearray:
    buffer = bytearray(wv.total_bytes)
    async for response in stub.FetchWeights(
        learner_pb2.FetchWeightsRequest(version=wv.version), timeout=TIMEOUT
    ):
        chunk = response.chunk
        assert chunk.version == wv.version and len(chunk.data) <= 1 << 20
        buffer[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
    return buffer


async def test_train_step_advances_the_weight_version(learner, model_dir):
    stub, _ = learner
    state = await stub.GetLearnerState(learner_pb2.GetLearnerStateRequest(), timeout=TIMEOUT)
    assert (state.weight_version, state.step, state.loss) == (0, 0, "grpo")
    assert (state.ranks, state.sharded) == (1, False)
    response = await stub.TrainStep(
        learner_pb2.TrainStepRequest(batch=make_batch(vocab_of(model_dir))), timeout=TIMEOUT
    )
    result = response.result
    assert (result.step, result.weight_version) == (1, 1)
    for key in (
        "loss",
        "entropy",
        "ratio_mean",
        "clip_frac",
        "mismatch_kl",
        "grad_norm",
        "lr",
        "tokens_per_s",
    ):
        assert key in result.metrics
    assert result.metrics["num_seqs"] == 6
    # a retry of the same batch is answered from the last result, not trained twice
    again = await stub.TrainStep(
        learner_pb2.TrainStepRequest(batch=make_batch(vocab_of(model_dir))), timeout=TIMEOUT
    )
    assert again.result.weight_version == 1
    # a batch meant for another step is refused
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.TrainStep(
            learner_pb2.TrainStepRequest(batch=make_batch(vocab_of(model_dir), step=5, batch_id="b5")),
            timeout=TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_grpc_stream_weights_reassemble_and_verify(learner, model_dir):
    stub, app = learner
    await stub.TrainStep(learner_pb2.TrainStepRequest(batch=make_batch(vocab_of(model_dir))), timeout=TIMEOUT)
    response = await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=GRPC), timeout=TIMEOUT)
    wv = response.weight_version
    assert wv.version == 1 and wv.WhichOneof("transport") == "grpc_stream"
    assert wv.grpc_stream.address == f"127.0.0.1:{app.bound_port}"
    assert wv.grpc_stream.chunk_bytes == 1 << 20
    manifest = weights.manifest_from_proto(wv)
    buffer = await fetch_all(stub, wv)
    weights.verify_buckets(memoryview(buffer), manifest)
    received = dict(weights.iter_tensors(memoryview(buffer), manifest.tensors))
    expected = app.trainer.export()
    assert list(received) == list(expected) and "lm_head.weight" in received
    for name, tensor in expected.items():
        assert torch.equal(received[name], tensor), name
    state = await stub.GetLearnerState(learner_pb2.GetLearnerStateRequest(), timeout=TIMEOUT)
    assert list(state.prepared_versions) == [1]
    await stub.ReleaseWeights(learner_pb2.ReleaseWeightsRequest(version=1), timeout=TIMEOUT)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fetch_all(stub, wv)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_shared_memory_segment_readable_and_unlinked_on_release(learner):
    stub, app = learner
    response = await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=SHM), timeout=TIMEOUT)
    wv = response.weight_version
    assert wv.WhichOneof("transport") == "shared_memory" and wv.shared_memory.size == wv.total_bytes
    manifest = weights.manifest_from_proto(wv)
    segment = attach_segment(wv.shared_memory.segment_name)
    try:
        weights.verify_buckets(segment.buf, manifest)
        name, tensor = next(weights.iter_tensors(segment.buf, manifest.tensors))
        assert torch.equal(tensor, app.trainer.export()[name])
        del tensor
    finally:
        segment.close()
    await stub.ReleaseWeights(learner_pb2.ReleaseWeightsRequest(version=wv.version), timeout=TIMEOUT)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=wv.shared_memory.segment_name)


async def test_prepared_versions_are_bounded_and_kinds_checked(learner, model_dir):
    stub, _ = learner
    first = await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=GRPC), timeout=TIMEOUT)
    again = await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=GRPC), timeout=TIMEOUT)
    assert again.weight_version == first.weight_version  # same version, same snapshot
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=SHM), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await stub.TrainStep(learner_pb2.TrainStepRequest(batch=make_batch(vocab_of(model_dir))), timeout=TIMEOUT)
    await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=SHM), timeout=TIMEOUT)
    await stub.TrainStep(
        learner_pb2.TrainStepRequest(batch=make_batch(vocab_of(model_dir), step=1, batch_id="b1")),
        timeout=TIMEOUT,
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:  # max_prepared_versions = 2
        await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=GRPC), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # stop() unlinks what is still prepared (checked via the store being empty afterwards)


@pytest.mark.parametrize(
    ("kind", "code"),
    [
        (types_pb2.WEIGHT_TRANSPORT_KIND_CUDA_IPC, grpc.StatusCode.FAILED_PRECONDITION),
        (types_pb2.WEIGHT_TRANSPORT_KIND_CHECKPOINT, grpc.StatusCode.FAILED_PRECONDITION),
        (types_pb2.WEIGHT_TRANSPORT_KIND_NCCL, grpc.StatusCode.INVALID_ARGUMENT),  # no receivers named
        (types_pb2.WEIGHT_TRANSPORT_KIND_UNSPECIFIED, grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
async def test_unsupported_transports(learner, kind, code):
    stub, _ = learner
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=kind), timeout=TIMEOUT)
    assert err.value.code() == code
    if kind == types_pb2.WEIGHT_TRANSPORT_KIND_CHECKPOINT:
        assert "not implemented yet" in err.value.details()


async def test_nccl_describes_a_group_of_the_named_receivers(learner):
    stub, _ = learner
    receivers = [
        learner_pb2.WeightReceiver(rollout_id="b", instance_id="b1", workers=2),
        learner_pb2.WeightReceiver(rollout_id="a", instance_id="a1", workers=1),
    ]
    request = learner_pb2.PrepareWeightsRequest(
        transport=types_pb2.WEIGHT_TRANSPORT_KIND_NCCL, receivers=receivers
    )
    wv = (await stub.PrepareWeights(request, timeout=TIMEOUT)).weight_version
    assert wv.WhichOneof("transport") == "nccl" and wv.nccl.backend == "gloo"
    assert (wv.nccl.world_size, dict(wv.nccl.ranks)) == (4, {"a": 1, "b": 2})
    assert wv.checksum_algorithm == types_pb2.CHECKSUM_ALGORITHM_XXH3_64 and wv.nccl.master_port > 0
    await stub.ReleaseWeights(learner_pb2.ReleaseWeightsRequest(version=wv.version), timeout=TIMEOUT)


async def test_fetch_unknown_version_is_not_found(learner):
    stub, _ = learner
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.FetchWeights(learner_pb2.FetchWeightsRequest(version=42), timeout=TIMEOUT):
            pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _malformed(vocab: int) -> list[tuple[str, types_pb2.TrainBatch]]:
    empty = types_pb2.TrainBatch(batch_id="empty")
    short_logprobs = make_batch(vocab)
    del short_logprobs.groups[0].completions[1].logprobs[-1]
    missing_adv = make_batch(vocab)
    del missing_adv.groups[1].advantages[-1]
    bad_token = make_batch(vocab)
    bad_token.groups[0].completions[0].completion_token_ids[0] = vocab + 5
    no_completion = make_batch(vocab)
    del no_completion.groups[0].completions[0].completion_token_ids[:]
    del no_completion.groups[0].completions[0].logprobs[:]
    too_long = make_batch(vocab)
    too_long.groups[0].completions[0].prompt_token_ids.extend([1] * 4096)
    return [
        ("no groups", empty),
        ("exceed the model", too_long),
        ("logprobs", short_logprobs),
        ("advantages", missing_adv),
        ("outside the vocabulary", bad_token),
        ("empty completion", no_completion),
    ]


async def test_malformed_batches_are_invalid_argument_and_server_keeps_serving(learner, model_dir):
    stub, _ = learner
    for needle, batch in _malformed(vocab_of(model_dir)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.TrainStep(learner_pb2.TrainStepRequest(batch=batch), timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
        assert needle in err.value.details()
    state = await stub.GetLearnerState(learner_pb2.GetLearnerStateRequest(), timeout=TIMEOUT)
    assert state.weight_version == 0
    ok = await stub.TrainStep(
        learner_pb2.TrainStepRequest(batch=make_batch(vocab_of(model_dir))), timeout=TIMEOUT
    )
    assert ok.result.weight_version == 1


async def test_score_tokens_matches_direct_log_softmax(learner, model_dir):
    stub, _ = learner
    from transformers import AutoModelForCausalLM

    prompt, completion, temperature = [1, 2, 3, 4, 5], [6, 7, 8], 0.8
    seq = types_pb2.TokenSequence(
        prompt_token_ids=prompt, completion_token_ids=completion, temperature=temperature
    )
    response = await stub.ScoreTokens(learner_pb2.ScoreTokensRequest(sequence=seq), timeout=TIMEOUT)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].double()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    expected = [logprobs[len(prompt) - 1 + k, t].item() for k, t in enumerate(completion)]
    assert list(response.logprobs) == pytest.approx(expected, abs=1e-4)
    assert response.weight_version == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        bad = types_pb2.TokenSequence(prompt_token_ids=prompt, completion_token_ids=[], temperature=1.0)
        await stub.ScoreTokens(learner_pb2.ScoreTokensRequest(sequence=bad), timeout=TIMEOUT)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_stop_checkpoints_and_a_new_learner_resumes(model_dir, tmp_path):
    settings = LearnerSettings.load(
        model=str(model_dir), device="cpu", port=0, checkpoint={"dir": tmp_path}, grace_seconds=1.0
    )
    app = LearnerApp(settings)
    running = await start_server(app, settings)
    channel = open_channel(running.address)
    stub = learner_pb2_grpc.LearnerServiceStub(channel)
    await stub.TrainStep(learner_pb2.TrainStepRequest(batch=make_batch(vocab_of(model_dir))), timeout=TIMEOUT)
    first = await stub.GetLearnerState(learner_pb2.GetLearnerStateRequest(), timeout=TIMEOUT)
    assert (first.last_batch_id, first.step) == ("b0", 1) and first.lineage_id and first.instance_id
    await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=SHM), timeout=TIMEOUT)
    segment_name = app.learner.store.get(1).segment_name
    await channel.close()
    await running.close()  # what SIGTERM does: checkpoint + free prepared versions
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=segment_name)

    resume = settings.checkpoint.model_copy(update={"resume": True})
    resumed = LearnerApp(settings.model_copy(update={"checkpoint": resume}))
    running = await start_server(resumed, settings)
    try:
        assert (resumed.learner.trainer.weight_version, resumed.learner.trainer.last_batch_id) == (1, "b0")
        channel = open_channel(running.address)
        stub = learner_pb2_grpc.LearnerServiceStub(channel)
        again = await stub.GetLearnerState(learner_pb2.GetLearnerStateRequest(), timeout=TIMEOUT)
        await channel.close()
        # the same lineage (the checkpoint directory's), a new process
        assert (again.lineage_id, again.last_batch_id) == (first.lineage_id, "b0")
        assert again.instance_id != first.instance_id
    finally:
        await running.close()
    (tmp_path / "lineage.json").write_text('{"lineage_id": "another-run"}')
    with pytest.raises(ValueError, match="checkpoints of two runs are mixed"):
        Trainer(settings.model_copy(update={"checkpoint": resume}))
