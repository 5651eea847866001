"""LoRA adapter versions on the transformers engine (services/rollout/adapters.py), over a real rollout
server and the grpc_stream transport: the learner's own export (`export_state(..., "adapter")`) goes
in, the learner's own peft model is the reference."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from transports.support import Packed, WeightsServer, reference_logprobs

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2
from rollout.test_rollout_grpc import _check_policy, _close, _start, _text_prompt, settings_for
from services.common.weights import LoraSpec, adapter_to_proto
from services.learner.config import LoraConfig
from services.learner.model import export_state, load_policy
from services.rollout import adapters

pytestmark = pytest.mark.asyncio(loop_scope="module")
TIMEOUT = 60.0
SPEC = LoraSpec(4, 16.0, ("q_proj", "v_proj", "down_proj"))


def lora_learner(model_dir: Path, seed: int, spec: LoraSpec = SPEC) -> torch.nn.Module:
    """The learner's peft model with seeded, non-zero adapters (as after some training)."""
    lora = LoraConfig(rank=spec.rank, alpha=spec.alpha, target_modules=spec.target_modules)
    model = load_policy(str(model_dir), torch.device("cpu"), lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


def adapter_version(learner: WeightsServer, version: int, model, spec: LoraSpec = SPEC):
    message = learner.publish(version, Packed(dict(export_state(model, "adapter"))))
    adapter_to_proto(spec, message)
    return message


async def test_the_expected_adapter_is_what_peft_makes(tiny_model_dir: Path) -> None:
    """`adapter_shapes` (the check before any weight changes) names and shapes exactly the tensors
    the learner exports, over a plain model and over one already wrapped."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    exported = {
        k: tuple(v.shape) for k, v in export_state(lora_learner(tiny_model_dir, 0), "adapter").items()
    }
    assert adapters.adapter_shapes(base, SPEC) == exported
    assert adapters.adapter_shapes(adapters.wrapped(base, SPEC), SPEC) == exported


async def test_adapter_versions_are_served_over_the_base_then_whole_weights_again(
    tiny_model_dir: Path,
) -> None:
    server = await _start(settings_for(tiny_model_dir, rollout_id="hf-adapter"))
    prompt = _text_prompt("5+6=")

    async def sync(message: types_pb2.WeightVersion) -> None:
        await server.stub.StageWeights(
            rollout_pb2.StageWeightsRequest(weight_version=message), timeout=TIMEOUT
        )
        await server.stub.CommitWeights(
            rollout_pb2.CommitWeightsRequest(version=message.version), timeout=TIMEOUT
        )

    try:
        async with WeightsServer() as learner:
            one, two = lora_learner(tiny_model_dir, 1), lora_learner(tiny_model_dir, 2)
            await sync(adapter_version(learner, 1, one))
            await _check_policy(server, prompt, one, version=1)  # within 1e-4 of the learner's peft model
            await sync(adapter_version(learner, 2, two))  # the next adapter overwrites the first
            await _check_policy(server, prompt, two, version=2)
            completion = (await server.generate(prompt, n=1, temperature=1.0, max_tokens=6))[0]
            ids = list(completion.prompt_token_ids), list(completion.completion_token_ids)
            with two.disable_adapter():  # the base model
                base = reference_logprobs(two, *ids, 1.0)
            assert (torch.tensor(list(completion.logprobs)) - base).abs().max() > 1e-2  # not the base's

            await _check_refusals(server, learner, two)
            assert (await server.state()).weight_version == 2
            await _check_policy(server, prompt, two, version=2)  # a refused version changed nothing

            merged = dict(export_state(lora_learner(tiny_model_dir, 3), "full"))  # LoRA merged: whole weights
            await sync(learner.publish(5, Packed(merged)))
            reference = lora_learner(tiny_model_dir, 3)
            await _check_policy(server, prompt, reference, version=5)
    finally:
        await _close(server)


async def _check_refusals(server, learner: WeightsServer, model) -> None:
    async def stage(message):
        return await server.stub.StageWeights(
            rollout_pb2.StageWeightsRequest(weight_version=message), timeout=TIMEOUT
        )

    # an adapter whose tensors are not its rank's: refused at commit, the staged version kept for a retry
    wrong_rank = adapter_version(learner, 3, model, LoraSpec(8, 16.0, SPEC.target_modules))
    await stage(wrong_rank)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await server.stub.CommitWeights(rollout_pb2.CommitWeightsRequest(version=3), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "lora_A.weight has shape [4, 128], the model [8, 128]" in info.value.details(), (
        info.value.details()
    )
    await server.stub.AbortWeights(rollout_pb2.AbortWeightsRequest(version=3), timeout=TIMEOUT)
    # modules this model does not have
    elsewhere = adapter_version(learner, 3, model, LoraSpec(4, 16.0, ("c_attn",)))
    await stage(elsewhere)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await server.stub.CommitWeights(rollout_pb2.CommitWeightsRequest(version=3), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "['c_attn']" in info.value.details()
    await server.stub.AbortWeights(rollout_pb2.AbortWeightsRequest(version=3), timeout=TIMEOUT)
    # malformed: caught when the message is read, before anything is fetched
    whole = learner.publish(4, Packed({"model.norm.weight": torch.ones(64)}))
    adapter_to_proto(SPEC, whole)
    zero_rank = adapter_version(learner, 4, model, LoraSpec(0, 16.0, SPEC.target_modules))
    for message, needle in [(whole, "is not a LoRA tensor"), (zero_rank, "needs rank > 0")]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stage(message)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in info.value.details()
