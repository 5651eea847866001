"""RestoreCheckpoint through a real in-process gRPC server on the tiny model: a learner ahead of its
run's ledger (a power loss took the ledger's last writes) goes back to a checkpoint the ledger knows."""

from __future__ import annotations

import grpc
import pytest
import torch
from safetensors.torch import load_file

from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.clients import open_channel
from services.common.serve import start_server
from services.learner.config import LearnerSettings
from services.learner.model import trainable_state
from services.learner.server import LearnerApp
from tests.learner.test_learner_grpc import SHM, TIMEOUT, make_batch, vocab_of


@pytest.fixture
async def trained(model_dir, tmp_path):
    """(stub, app, checkpoint dir) of a learner that trained 4 steps, a checkpoint each, keeping 2."""
    settings = LearnerSettings.load(
        model=str(model_dir),
        device="cpu",
        port=0,
        optim={"lr": 1e-2},
        checkpoint={"dir": tmp_path / "ckpt", "every": 1, "keep": 2, "background": False},
        grace_seconds=1.0,
    )
    app = LearnerApp(settings)
    running = await start_server(app, settings)
    channel = open_channel(running.address)
    stub = learner_pb2_grpc.LearnerServiceStub(channel)
    try:
        for step in range(4):
            batch = make_batch(vocab_of(model_dir), step=step, batch_id=f"b{step}")
            await stub.TrainStep(learner_pb2.TrainStepRequest(batch=batch), timeout=TIMEOUT)
        yield stub, app, tmp_path / "ckpt"
    finally:
        await channel.close()
        await running.close()


def _steps(root) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".") and p.is_dir())


async def _restore(stub, lineage: str, max_step: int, min_step: int = 0):
    request = learner_pb2.RestoreCheckpointRequest(lineage_id=lineage, max_step=max_step, min_step=min_step)
    return await stub.RestoreCheckpoint(request, timeout=TIMEOUT)


async def test_a_learner_goes_back_to_its_newest_checkpoint_at_or_before_a_step(trained, model_dir) -> None:
    stub, app, root = trained
    state = await stub.GetLearnerState(learner_pb2.GetLearnerStateRequest(), timeout=TIMEOUT)
    assert state.step == 4 and _steps(root) == ["step_00000003", "step_00000004"]
    await stub.PrepareWeights(learner_pb2.PrepareWeightsRequest(transport=SHM), timeout=TIMEOUT)

    for lineage, code in (
        ("", grpc.StatusCode.INVALID_ARGUMENT),
        ("other", grpc.StatusCode.FAILED_PRECONDITION),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await _restore(stub, lineage, 3)
        assert caught.value.code() == code
    assert app.learner.trainer.step == 4 and len(_steps(root)) == 2  # refused: nothing changed

    restored = await _restore(stub, state.lineage_id, 3)
    assert (restored.step, restored.weight_version, restored.last_batch_id, restored.previous_step) == (
        3, 3, "b2", 4,
    )  # fmt: skip
    assert _steps(root) == ["step_00000003"]  # the newer checkpoint is gone: a restart resumes here
    saved = load_file(str(root / "step_00000003" / "model.safetensors"))
    live = trainable_state(app.learner.trainer.model)
    assert all(torch.equal(live[name], saved[name]) for name in saved)
    after = await stub.GetLearnerState(learner_pb2.GetLearnerStateRequest(), timeout=TIMEOUT)
    assert not after.prepared_versions  # version numbers from here name other weights
    assert (after.lineage_id, after.instance_id) == (state.lineage_id, state.instance_id)
    again = await _restore(stub, state.lineage_id, 3)  # a retried call: nothing more to do
    assert (again.step, again.previous_step) == (3, 3) and _steps(root) == ["step_00000003"]

    # the ledger knows 2 steps and was started at step 1: only step 0 (the model as loaded) is at
    # or before 2, and that is before 1: refused, the step-3 checkpoint kept
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _restore(stub, state.lineage_id, 2, min_step=1)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert app.learner.trainer.step == 3 and _steps(root) == ["step_00000003"]

    # with nothing kept at or before step 2: the model as loaded, and it trains on from there
    restored = await _restore(stub, state.lineage_id, 2)
    assert (restored.step, restored.last_batch_id, restored.previous_step) == (0, "", 3) and not _steps(root)
    loaded = load_file(str(model_dir / "model.safetensors"))
    live = trainable_state(app.learner.trainer.model)
    shared = [name for name in loaded if name in live]
    assert shared and all(torch.equal(live[name], loaded[name].to(live[name].dtype)) for name in shared)
    batch = make_batch(vocab_of(model_dir), step=0, batch_id="b0")
    result = await stub.TrainStep(learner_pb2.TrainStepRequest(batch=batch), timeout=TIMEOUT)
    assert (result.result.step, result.result.weight_version) == (1, 1)
