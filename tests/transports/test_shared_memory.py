"""The shared_memory transport's three halves on real POSIX segments, and the segment plumbing."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.common.v1 import types_pb2
from services.common.errors import DataLoss, FailedPrecondition
from services.common.weights import (
    build_manifest,
    iter_tensors,
    manifest_to_proto,
    packed_size,
    plan_layout,
)
from services.transports import LoadPlan, PublishContext, StageContext, TransportKind, WorkerContext
from services.transports import registry as transports
from services.transports.shared_memory import attach_segment, create_segment

from .support import Packed, sample_state

CTX = StageContext(rollout_id="test", fetch_timeout_s=30)


def _publish_ctx() -> PublishContext:
    return PublishContext(f"t{uuid.uuid4().hex[:6]}", 256 << 10, 1 << 20, lambda: "unused:0")


async def test_learner_rollout_and_engine_halves_round_trip() -> None:
    state = sample_state()
    transport = transports.get(TransportKind.shared_memory)
    prepared = transport.prepare(3, state, _publish_ctx())
    try:
        message = transports.describe(prepared)
        assert message.WhichOneof("transport") == "shared_memory"
        assert message.shared_memory.size == message.total_bytes == prepared.manifest.total_bytes
        target = transports.target_from_proto(message)
        staged = await transport.stage(target, CTX)
        assert staged.plan == LoadPlan(TransportKind.shared_memory, {"segment_name": prepared.segment_name})
        worker = WorkerContext(state={}, local_rank=0, device=torch.device("cpu"))
        with transports.open_tensors(staged.plan, list(staged.manifest.tensors), worker) as tensors:
            loaded = {name: t.clone() for name, t in tensors}
        assert all(torch.equal(loaded[n], t) for n, t in state.items())
        staged.release()
        staged.release()  # idempotent
        again = await transport.stage(target, CTX)  # the rollout's release left the learner's segment
        again.release()
    finally:
        prepared.close()
    with pytest.raises(FileNotFoundError):  # the learner's release unlinks it
        attach_segment(message.shared_memory.segment_name)


async def test_stage_verifies_checksums_and_refuses_missing_segments() -> None:
    packed = Packed(sample_state(1))
    name = f"grpo_{uuid.uuid4().hex[:8]}_v5"
    producer = packed.to_segment(name)
    transport = transports.get(TransportKind.shared_memory)
    try:
        message = packed.weight_version(5)
        message.shared_memory.segment_name = name
        message.shared_memory.size = len(packed.data)
        staged = await transport.stage(transports.target_from_proto(message), CTX)
        staged.release()
        producer.buf[10] ^= 0xFF
        with pytest.raises(DataLoss, match="bucket 0"):
            await transport.stage(transports.target_from_proto(message), CTX)
    finally:
        producer.close()
        producer.unlink()
    with pytest.raises(FailedPrecondition, match="does not exist"):
        await transport.stage(transports.target_from_proto(message), CTX)


def test_create_attach_read_unlink() -> None:
    state = sample_state()
    size = packed_size(plan_layout(state))
    name = f"grpo-test-{uuid.uuid4().hex[:10]}"
    producer = create_segment(name, size)
    try:
        manifest = build_manifest(state, producer.buf[:size], bucket_bytes=256)
        consumer = attach_segment(name)
        try:
            view = consumer.buf[: manifest.total_bytes]
            rebuilt = {n: t.clone() for n, t in iter_tensors(view, manifest.tensors)}
            del view
        finally:
            consumer.close()
        assert all(torch.equal(rebuilt[n], t) for n, t in state.items())
    finally:
        producer.close()
        producer.unlink()
    with pytest.raises(FileNotFoundError):
        attach_segment(name)


_CONSUMER = """
import sys
from pathlib import Path
from safetensors.torch import save_file
from grpo.common.v1 import types_pb2
from services.common.weights import iter_tensors, manifest_from_proto, verify_buckets
from services.transports.shared_memory import attach_segment
manifest = manifest_from_proto(types_pb2.WeightVersion.FromString(Path(sys.argv[2]).read_bytes()))
segment = attach_segment(sys.argv[1])
view = segment.buf[: manifest.total_bytes]
verify_buckets(view, manifest)
save_file({n: t.clone() for n, t in iter_tensors(view, manifest.tensors)}, sys.argv[3])
del view
segment.close()
"""


def test_consumer_process_reads_segment_and_exit_does_not_unlink_it(tmp_path) -> None:
    state = {k: v.contiguous() for k, v in sample_state().items() if v.numel()}
    size = packed_size(plan_layout(state))
    name = f"grpo-test-{uuid.uuid4().hex[:10]}"
    producer = create_segment(name, size)
    try:
        manifest = build_manifest(state, producer.buf[:size], bucket_bytes=256)
        message = types_pb2.WeightVersion(version=1)
        manifest_to_proto(manifest, message)
        (tmp_path / "manifest.pb").write_bytes(message.SerializeToString())
        out = tmp_path / "read.safetensors"
        args = [sys.executable, "-c", _CONSUMER, name, str(tmp_path / "manifest.pb"), str(out)]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "leaked shared_memory" not in done.stderr
        rebuilt = load_file(out)
        assert all(torch.equal(rebuilt[n], t) for n, t in state.items())
        assert Path("/dev/shm", name).exists(), "the consumer's exit must not unlink the producer's segment"
    finally:
        producer.close()
        producer.unlink()
