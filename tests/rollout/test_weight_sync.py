"""The rollout's one staged slot (services/rollout/weight_sync.py): version rules, retries, abort, put back.
The transports' own staging (fetch, attach, checksums) is tested in tests/transports."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transports.support import Packed, WeightsServer

from services.common.deadlines import TransferDeadline
from services.common.errors import Aborted, DeadlineExceeded, FailedPrecondition
from services.rollout.weight_sync import WeightStager
from services.transports import StageTarget, TransportKind
from services.transports import registry as transports

DEADLINE = TransferDeadline(floor_s=30)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=generator), "c.steps": torch.arange(5)}


async def test_slot_rules_retry_replace_take_put_back_abort() -> None:
    stager = WeightStager("test", DEADLINE)
    async with WeightsServer() as server:
        v1 = transports.target_from_proto(server.publish(1, Packed(_state(1))))
        v2 = transports.target_from_proto(server.publish(2, Packed(_state(2))))
        staged = await stager.stage(v1, current_version=0)
        assert stager.staged_version == 1
        assert await stager.stage(v1, current_version=0) is staged  # a retried StageWeights: no refetch
        newer = await stager.stage(v2, current_version=0)  # a newer version replaces the staged one
        assert stager.staged_version == 2
        with pytest.raises(Aborted, match="already staged"):
            await stager.stage(v1, current_version=0)
        with pytest.raises(FailedPrecondition, match="v2 is"):
            await stager.take(1)
        taken = await stager.take(2)
        assert taken is newer and stager.staged_version == -1
        await stager.put_back(taken)  # a failed load: the next CommitWeights can retry it
        assert stager.staged_version == 2
        assert not await stager.abort(1)
        assert await stager.abort(2)
        assert stager.staged_version == -1
        stager.close()


async def test_a_rewind_stages_an_older_version_than_the_loaded_or_staged_one() -> None:
    """After a learner restart from an older checkpoint the scheduler moves rollouts back (`rewind`)."""
    stager = WeightStager("test", DEADLINE)
    async with WeightsServer() as server:
        v2 = transports.target_from_proto(server.publish(2, Packed(_state(2))))
        v3 = transports.target_from_proto(server.publish(3, Packed(_state(3))))
        with pytest.raises(Aborted, match="not newer"):
            await stager.stage(v2, current_version=3)
        await stager.stage(v3, current_version=1)
        with pytest.raises(Aborted, match="already staged"):
            await stager.stage(v2, current_version=1)
        rewound = await stager.stage(v2, current_version=3, rewind=True)
        assert rewound.version == stager.staged_version == 2
        assert (await stager.take(2)) is rewound
        rewound.release()
        stager.close()


async def test_the_same_version_described_anew_is_staged_again() -> None:
    # A retry of the same StageWeights reuses the slot; a new PrepareWeights of that version (a new
    # nccl broadcast, another learner address) is a different transfer and must be staged again:
    # for nccl, answering from the slot would leave the learner's broadcast without this member.
    stager = WeightStager("test", DEADLINE)
    async with WeightsServer() as first, WeightsServer() as second:
        packed = Packed(_state(1))
        v1 = transports.target_from_proto(first.publish(1, packed))
        again = transports.target_from_proto(second.publish(1, packed))
        assert again.manifest == v1.manifest and again.descriptor != v1.descriptor
        staged = await stager.stage(v1, current_version=0)
        restaged = await stager.stage(again, current_version=0)
        assert restaged is not staged and stager.staged_version == 1
        assert await stager.stage(again, current_version=0) is restaged
        stager.close()


async def test_versions_not_newer_than_loaded_and_planned_transports_are_refused() -> None:
    packed = Packed(_state())
    stager = WeightStager("t", DEADLINE)
    with pytest.raises(Aborted, match="not newer"):
        await stager.stage(
            StageTarget(3, packed.manifest, TransportKind.grpc_stream, None), current_version=3
        )
    with pytest.raises(FailedPrecondition, match="checkpoint weight transport is not implemented yet"):
        await stager.stage(StageTarget(4, packed.manifest, TransportKind.checkpoint, None), current_version=3)
    with pytest.raises(FailedPrecondition, match="not staged"):
        await stager.take(3)


class SlowWeightsServer(WeightsServer):
    """A real FetchWeights server whose streams start `delay_s` late (a learner under load)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        serve = self.servicer.FetchWeights

        async def late(request, context):
            await asyncio.sleep(delay_s)
            async for response in serve(request, context):
                yield response

        self.servicer.FetchWeights = late


async def test_the_fetch_deadline_grows_with_the_versions_bytes() -> None:
    """floor_s + total_bytes at min_rate_mb_s: a stream 2 s late misses a 0.3 s floor when the bytes add
    almost nothing, and makes it when they add ~20 s (a fixed deadline would treat both alike)."""
    packed = Packed(_state(1))
    nbytes = packed.manifest.total_bytes
    tight = TransferDeadline(floor_s=0.3, min_rate_mb_s=1e6)  # the bytes add nanoseconds
    roomy = TransferDeadline(floor_s=0.3, min_rate_mb_s=nbytes / 1e6 / 20)  # the bytes add 20 s
    assert tight.for_bytes(nbytes) < 0.31 and roomy.for_bytes(nbytes) == pytest.approx(20.3)
    async with SlowWeightsServer(delay_s=2.0) as server:
        target = transports.target_from_proto(server.publish(1, packed))
        stager = WeightStager("test", tight)
        with pytest.raises(DeadlineExceeded):
            await stager.stage(target, current_version=0)
        stager.close()
        stager = WeightStager("test", roomy)
        staged = await stager.stage(target, current_version=0)
        assert staged.version == 1
        stager.close()


async def test_an_engine_without_adapters_refuses_an_adapter_version_before_fetching_it() -> None:
    """A rollout whose engine cannot serve LoRA adapters says so at StageWeights (FAILED_PRECONDITION,
    with what to do), never loads the adapter tensors as if they were the model."""
    from services.common.weights import LoraSpec, adapter_to_proto

    stager = WeightStager("test", DEADLINE, adapters="publish merged weights")
    lora = {"x.lora_A.weight": torch.randn(4, 32), "x.lora_B.weight": torch.zeros(64, 4)}
    async with WeightsServer() as server:
        message = server.publish(1, Packed(lora))
        adapter_to_proto(LoraSpec(4, 8.0, ("x",)), message)
        with pytest.raises(FailedPrecondition, match="version 1 is a LoRA adapter: publish merged weights"):
            await stager.stage(transports.target_from_proto(message), current_version=0)
        assert stager.staged_version == -1
        whole = WeightStager("test", DEADLINE)  # an engine that serves them stages it like any version
        assert (await whole.stage(transports.target_from_proto(message), current_version=0)).version == 1
        whole.close()
    stager.close()
