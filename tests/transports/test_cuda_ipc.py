"""The cuda_ipc transport. On CPU: the checks a receiver makes before touching any memory (device by
UUID, the manifest against the export's byte ranges, dtypes, checksum algorithm), the descriptor's
validation, and precise refusals without a GPU. On a GPU (marker `gpu`): a learner export attached
and verified through the engine half, zero copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from grpo.common.v1 import types_pb2
from services.common import weights
from services.common.checksums import ChecksumAlgorithm
from services.common.errors import FailedPrecondition, InvalidArgument
from services.transports import PublishContext, TransportKind, WorkerContext
from services.transports import registry as transports
from services.transports.cuda_ipc import IpcExport, check_export
from services.transports.cuda_ipc_fence import Holder, SlotFence

IPC = transports.get(TransportKind.cuda_ipc)
UUID = "GPU-5a1c0de0-0000-4000-8000-000000000001"


def _manifest(algorithm: ChecksumAlgorithm = ChecksumAlgorithm.wsum64) -> weights.Manifest:
    tensors = (
        weights.TensorEntry("a.weight", "float32", (4, 8), 0, 128),
        weights.TensorEntry("b.weight", "bfloat16", (16,), 128, 32),
    )
    return weights.Manifest(tensors, (weights.BucketEntry(0, 0, 192, "0" * 16),), 192, algorithm)


def _export(**changes) -> IpcExport:
    base = IpcExport(0, UUID, b"\x01" * 64, 4096, 512, 1024, b"ref", 8, b"event", True)
    return replace(base, **changes)


def test_a_consistent_export_on_the_same_gpu_is_accepted() -> None:
    check_export(_manifest(), _export(), UUID)
    # a buffer the caching allocator carved out of a larger segment: its storage starts 8,704 bytes
    # into the allocation the handle opens (as exported on an H200)
    check_export(_manifest(), _export(storage_size_bytes=1024, storage_offset_bytes=8704), UUID)


@pytest.mark.parametrize(
    ("manifest", "export", "local", "error", "needle"),
    [
        (_manifest(), _export(), None, FailedPrecondition, "on a CUDA device"),
        (_manifest(), _export(), "GPU-other", FailedPrecondition, "only works on the same physical GPU"),
        (_manifest(), _export(handle=b""), UUID, InvalidArgument, "no memory handle"),
        (_manifest(), _export(storage_size_bytes=1000), UUID, InvalidArgument, "larger than its storage"),
        (_manifest(), _export(nbytes=100), UUID, InvalidArgument, "manifest needs 192 bytes"),
        (_manifest(ChecksumAlgorithm.xxh3_64), _export(), UUID, InvalidArgument, "wsum64"),
        (
            replace(_manifest(), tensors=(weights.TensorEntry("x", "complex32", (2,), 0, 8),)),
            _export(),
            UUID,
            InvalidArgument,
            "complex32",
        ),
        (
            replace(_manifest(), tensors=(weights.TensorEntry("x", "float32", (300,), 0, 1200),)),
            _export(),
            UUID,
            InvalidArgument,
            "outside the exported buffer",
        ),
    ],
)
def test_receivers_refuse_what_they_must_not_read(manifest, export, local, error, needle) -> None:
    with pytest.raises(error, match=needle):
        check_export(manifest, export, local)


def test_descriptor_round_trip_and_malformed_descriptors() -> None:
    message = types_pb2.WeightVersion(version=2)
    export = _export()
    message.cuda_ipc.buckets.add(
        device_uuid=export.device_uuid, handle=export.handle, storage_offset=export.storage_offset_bytes,
        nbytes=export.nbytes, ref_counter_handle=export.ref_counter_handle,
        ref_counter_offset=export.ref_counter_offset, event_handle=export.event_handle,
        storage_size_bytes=export.storage_size_bytes, event_sync_required=True, slot=0,
    )  # fmt: skip
    assert IPC.read_descriptor(message) == export
    assert IpcExport.from_spec(export.to_spec()) == export  # the plain-data form workers get
    message.cuda_ipc.buckets.add(device_uuid=UUID)
    with pytest.raises(InvalidArgument, match="exactly one exported buffer"):
        IPC.read_descriptor(message)
    del message.cuda_ipc.buckets[:]
    message.cuda_ipc.buckets.add(device_uuid=UUID, nbytes=10)
    with pytest.raises(InvalidArgument, match="needs device_uuid, handle and nbytes"):
        IPC.read_descriptor(message)


def test_without_a_gpu_both_halves_refuse_precisely() -> None:
    ctx = PublishContext("run", 1 << 20, 1 << 20, lambda: "h:1")
    with pytest.raises(FailedPrecondition, match="needs the learner on a CUDA device"):
        IPC.prepare(1, {"w": torch.ones(2)}, ctx)
    worker = WorkerContext({}, 0, torch.device("cpu"))
    spec = {"version": 1, "export": _export().to_spec(), "algorithm": "wsum64", "total_bytes": 192}
    spec |= {"tensors": [["a.weight", "float32", [4, 8], 0, 128]], "buckets": [[0, 0, 192, "0" * 16]]}
    with pytest.raises(FailedPrecondition, match="on a CUDA device"):
        transports.worker_op("cuda_ipc", "attach", spec, worker)
    plan = transports.LoadPlan(TransportKind.cuda_ipc, {"version": 1})
    with (
        pytest.raises(FailedPrecondition, match="was not attached by this worker"),
        transports.open_tensors(plan, [], worker),
    ):
        pass


# The engine half, in a second process: CUDA opens no IPC handle in the process that exported it
# (on an H200 the same-process attach failed with "invalid device context"). Reads the WeightVersion
# as hex-encoded protobuf, stages (attach + verify) and opens the tensors, writes 42 into the first
# element of b.bias through its view, and reports what it read.
ENGINE_HALF = """
import asyncio, json, sys, torch
from grpo.common.v1 import types_pb2
from services.transports import StageContext, TransportKind, WorkerContext
from services.transports import registry as transports

message = types_pb2.WeightVersion.FromString(bytes.fromhex(sys.stdin.readline().strip()))
workers = transports.LocalWorkers(WorkerContext({}, 0, torch.device("cuda")))
ipc = transports.get(TransportKind.cuda_ipc)
staged = asyncio.run(ipc.stage(transports.target_from_proto(message), StageContext("r", 30, workers)))
out = {"zero_copy": staged.plan.zero_copy, "tensors": {}}
with transports.open_tensors(staged.plan, list(staged.manifest.tensors), workers.workers[0]) as views:
    for name, view in views:
        out["tensors"][name] = view.flatten().tolist()
        if name == "b.bias":
            view[0] = 42.0
    torch.cuda.synchronize()
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.gpu
def test_gpu_export_attach_verify_and_zero_copy_views() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    state = {"a.weight": torch.randn(64, 32, device=device), "b.bias": torch.randn(7, device=device)}
    ctx = PublishContext("run", 4096, 1 << 20, lambda: "h:1")
    prepared = IPC.prepare(3, state, ctx)
    message = transports.describe(prepared)
    assert message.checksum_algorithm == types_pb2.CHECKSUM_ALGORITHM_WSUM64

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run(
        [sys.executable, "-c", ENGINE_HALF], input=message.SerializeToString().hex() + "\n",
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    result = next((line for line in child.stdout.splitlines() if line.startswith("RESULT ")), None)
    assert result is not None, child.stdout[-2000:] + child.stderr[-4000:]
    out = json.loads(result.removeprefix("RESULT "))
    assert out["zero_copy"]
    for name, tensor in state.items():
        assert torch.equal(torch.tensor(out["tensors"][name]), tensor.flatten().cpu()), name
    # the child's write landed in this process's staging buffer: it read the learner's memory, no copy
    buffer = ctx.state["cuda_ipc"].buffers[3 % 2]
    views = dict(weights.tensor_views(buffer, list(prepared.manifest.tensors)))
    assert views["b.bias"][0].item() == 42.0
    assert torch.equal(views["b.bias"][1:], state["b.bias"][1:])
    prepared.close()


# ---- the learner-side fence (cuda_ipc_fence.py): pure, on CPU


def _held(*holders: tuple[str, int] | tuple[str, int, bool]) -> list[Holder]:
    """(rollout id, version[, owns_weights]), each of instance "i"."""
    return [Holder(rid, "i", version, *owns) for rid, version, *owns in holders]


def _publish(fence: SlotFence, version: int, receivers: list[str], holders: list[Holder]) -> int:
    """One sync as the learner sees it: choose a slot, describe it, release it after the commit."""
    slot = fence.choose(version, holders)
    fence.describe(slot, [(rid, "i") for rid in receivers])
    fence.released(slot)
    return slot


def test_the_fence_is_a_double_buffer_while_every_rollout_moves_on() -> None:
    fence = SlotFence()
    slots = [_publish(fence, 0, ["r0", "r1"], [])]
    for version in range(1, 6):
        slots.append(_publish(fence, version, ["r0", "r1"], _held(("r0", version - 1), ("r1", version - 1))))
    assert slots == [0, 1, 0, 1, 0, 1] and len(fence.slots) == 2


def test_a_buffer_an_unreachable_rollout_may_read_is_never_overwritten() -> None:
    """r1 committed version 1 (zero-copy, slot 1), then the scheduler lost it (a partition). It sent r1
    nothing since, so it still vouches that r1 serves 1: no later version goes into slot 1 until r1 is
    vouched for as off it."""
    fence = SlotFence(max_slots=3)
    _publish(fence, 0, ["r0", "r1"], [])
    assert _publish(fence, 1, ["r0", "r1"], _held(("r0", 0), ("r1", 0))) == 1
    for version, slot in ((2, 0), (3, 2), (4, 0), (5, 2)):  # only r0 is synced; slot 1 stays r1's
        assert _publish(fence, version, ["r0"], _held(("r0", version - 1), ("r1", 1))) == slot
    assert fence.slots[1].version == 1 and fence.slots[1].readers == {"r1": "i"}
    # r1 back and synced to version 5: slot 1 (the oldest version) is free again
    assert _publish(fence, 6, ["r0", "r1"], _held(("r0", 5), ("r1", 1))) == 0
    assert _publish(fence, 7, ["r0", "r1"], _held(("r0", 6), ("r1", 6))) == 1


def test_a_rollout_lost_mid_sync_fences_both_its_buffers_until_the_last_is_used() -> None:
    """r1 was lost while staging version 1: it may serve 0 (slot 0) or be reading 1 (slot 1), so the
    scheduler cannot vouch for it. Version 2 gets a third buffer; version 3 is refused, naming r1."""
    fence = SlotFence(max_slots=3)
    _publish(fence, 0, ["r0", "r1"], [])
    _publish(fence, 1, ["r0", "r1"], _held(("r0", 0), ("r1", 0)))
    assert _publish(fence, 2, ["r0"], _held(("r0", 1))) == 2
    with pytest.raises(FailedPrecondition, match=r"slot 0 \(version 0\) may still be read by r1"):
        fence.choose(3, _held(("r0", 2)))
    # r1 comes back: restarted (another instance), its mappings are gone
    assert _publish(fence, 3, ["r0", "r1"], [*_held(("r0", 2)), Holder("r1", "new", 0)]) == 0


def test_past_the_last_buffer_prepare_is_refused_naming_the_readers() -> None:
    fence = SlotFence(max_slots=2)
    _publish(fence, 0, ["r0", "r1"], [])
    _publish(fence, 1, ["r0", "r1"], _held(("r0", 0), ("r1", 0)))
    with pytest.raises(FailedPrecondition, match=r"slot 0 \(version 0\) may still be read by r1"):
        fence.choose(2, _held(("r0", 1)))  # r1 lost mid-sync: it may be on 0 or on 1
    # a copied-out reader, or a restarted one (another instance), reads no buffer
    assert fence.choose(2, [*_held(("r0", 1), ("r1", 1, True))]) == 0
    fence.released(0)
    assert fence.choose(3, [*_held(("r0", 2)), Holder("r1", "restarted", 0)]) == 1


def test_a_prepared_version_is_never_overwritten_and_a_retry_adds_its_readers() -> None:
    fence = SlotFence(max_slots=2)
    first = fence.choose(0, [])
    fence.describe(first, [("r0", "i")])
    second = fence.choose(1, _held(("r0", 0)))  # version 0 not released yet: its stage may be under way
    assert second != first
    with pytest.raises(FailedPrecondition, match="still prepared"):
        fence.choose(2, _held(("r0", 0)))
    fence.released(first)
    fence.describe(second, [("r1", "i")])  # a repeated PrepareWeights of version 1 named r1 too
    fence.released(second)
    assert fence.choose(2, _held(("r0", 1))) == first  # r0 moved off 0; r1 may read slot 1 (unlisted)
    fence.describe(first, [("r0", "i")])
    fence.released(first)
    with pytest.raises(FailedPrecondition, match="may still be read by r1"):
        fence.choose(3, _held(("r0", 2)))


def test_without_listed_holders_the_plain_double_buffer_is_kept() -> None:
    fence = SlotFence()
    assert [fence.choose(v, None) for v in (3, 4, 5)] == [1, 0, 1]


@pytest.mark.gpu
def test_gpu_an_unreachable_readers_buffer_keeps_its_bytes() -> None:
    """The real path: r1 committed version 1 (zero-copy), then was cut off; versions 2..4 go to other
    buffers and version 1's bytes stay as they were (before the fence, version 3 overwrote them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from services.transports.cuda_ipc_fence import HOLDERS_KEY
    from services.transports.kinds import Receiver

    device = torch.device("cuda")
    ctx = PublishContext("run", 4096, 1 << 20, lambda: "h:1")
    both = (Receiver("r0", "i", 1), Receiver("r1", "i", 1))

    def prepare(version: int, holders: list[Holder], receivers: tuple[Receiver, ...] = both):
        ctx.state[HOLDERS_KEY] = holders
        state = {"w": torch.full((1024,), float(version), device=device)}
        return IPC.prepare(version, state, ctx, receivers)

    prepare(0, []).close()
    one = prepare(1, _held(("r0", 0), ("r1", 0)))
    slot, size = one.export.slot, one.manifest.total_bytes
    kept = ctx.state["cuda_ipc"].buffers[slot][:size].clone()
    one.close()
    for version in (2, 3, 4):  # only r0 is synced; the scheduler still vouches r1 serves 1
        item = prepare(version, _held(("r0", version - 1), ("r1", 1)), both[:1])
        assert item.export.slot != slot
        item.close()
    assert torch.equal(ctx.state["cuda_ipc"].buffers[slot][:size], kept)
