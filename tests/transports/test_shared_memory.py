"""The shared_memory transport's three halves on real POSIX segments, and the segment plumbing."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo.common.v1 import types_pb2
from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument
from services.common.weights import (
    build_manifest,
    iter_tensors,
    manifest_to_proto,
    packed_size,
    plan_layout,
)
from services.transports import LoadPlan, PublishContext, StageContext, TransportKind, WorkerContext
from services.transports import registry as transports
from services.transports.shared_memory import (
    attach_segment,
    check_segment_name,
    create_segment,
    creator_gone,
    creator_token,
    reclaim_stale_segments,
    rollout_segment_name,
    segment_name,
    start_ticks,
)

from .support import Packed, sample_state

CTX = StageContext(rollout_id="test", fetch_timeout_s=30)
ROOT = Path(__file__).resolve().parents[2]


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


# ---- nothing leaks: the creator's resource tracker, creator tokens, reclaim_stale_segments

# A creator process: makes a segment the way the learner and the rollout do (`create_segment`; named
# with its creator token, or as given), optionally lets a spawned child attach it (as vLLM's engine
# process does, sharing this process's resource tracker), prints the name and waits for its end on stdin.
_CREATOR = """
import multiprocessing, sys
from services.transports.shared_memory import attach_segment, close_segment, create_segment, segment_name

def attach(name):
    close_segment(attach_segment(name))

if __name__ == "__main__":
    name = sys.argv[1] if sys.argv[1].startswith("grpo-") else segment_name(sys.argv[1], 1)
    segment = create_segment(name, 4096)
    name = segment.name
    if sys.argv[2] == "attached":
        child = multiprocessing.get_context("spawn").Process(target=attach, args=(name,))
        child.start()
        child.join()
        assert child.exitcode == 0
    print(name, flush=True)
    sys.stdin.read()
"""


def _start_creator(tmp_path: Path, attached: bool = False, run: str = "") -> tuple[subprocess.Popen, str]:
    """A creator of a learner-style segment of run `run` (a random one), or of the name `run` itself if
    it starts with `grpo-` (a name no reclaim looks at)."""
    script = tmp_path / "creator.py"
    script.write_text(_CREATOR)
    run = run or f"t{uuid.uuid4().hex[:8]}"
    process = subprocess.Popen(
        [sys.executable, str(script), run, "attached" if attached else "alone"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: itself and its resource tracker
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    name = process.stdout.readline().strip()
    assert name.startswith(run if run.startswith("grpo-") else f"grpo_{run}_"), name
    assert Path("/dev/shm", name).exists()
    return process, name


def _wait_gone(path: Path, within_s: float = 60.0) -> bool:
    deadline = time.monotonic() + within_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return not path.exists()


def _kill_group(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)


def test_a_killed_creators_tracker_unlinks_its_segment_even_after_a_child_attached(tmp_path) -> None:
    """The creator is SIGKILLed alone (its resource tracker lives on and sees it go). A spawned child
    that attached the segment shares the creator's tracker; an attach that registered and then
    unregistered the name there took the creator's only entry with it, and the segment leaked. (Named
    so that no reclaim, from a test running beside this one, could be what unlinks it.)"""
    process, name = _start_creator(tmp_path, attached=True, run=f"grpo-test-{uuid.uuid4().hex[:10]}")
    try:
        process.kill()
        process.wait(timeout=30)
        assert _wait_gone(Path("/dev/shm", name)), f"{name} leaked: its creator's tracker did not unlink it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            _kill_group(process)
        Path("/dev/shm", name).unlink(missing_ok=True)


def test_reclaim_unlinks_a_segment_whose_creator_was_killed_with_its_tracker(tmp_path) -> None:
    process, name = _start_creator(tmp_path)
    try:
        assert name not in reclaim_stale_segments()  # alive: kept
        _kill_group(process)  # the creator and its resource tracker: nobody is left to unlink it
        assert Path("/dev/shm", name).exists()  # the leak that reclaiming is for
        assert name in reclaim_stale_segments()  # (and any other dead creator's: as the launcher does)
        assert not Path("/dev/shm", name).exists()
        assert name not in reclaim_stale_segments()  # once
    finally:
        with contextlib.suppress(ProcessLookupError):
            _kill_group(process)
        Path("/dev/shm", name).unlink(missing_ok=True)


def test_reclaim_keeps_a_live_creators_segment(tmp_path) -> None:
    process, name = _start_creator(tmp_path)
    try:
        assert not creator_gone(name)
        assert name not in reclaim_stale_segments()
        assert Path("/dev/shm", name).exists()
    finally:
        process.stdin.close()  # it exits normally and unlinks through its tracker
        process.wait(timeout=30)
        assert _wait_gone(Path("/dev/shm", name))


def test_a_reused_pid_is_not_the_creator_and_unknown_names_are_never_reclaimed() -> None:
    """A name whose pid is alive but started at another time is a reused pid: stale. Names without a
    creator token (other programs', older ones) and other rollout ids are left alone."""
    pid, started, namespace = creator_token().split("-")
    assert int(started) == start_ticks(os.getpid())
    reused = f"grpo_rollout_r{uuid.uuid4().hex[:6]}_{pid}-{int(started) + 1}-{namespace}_0123abcd"
    mine = rollout_segment_name("r-" + uuid.uuid4().hex[:6])
    legacy = f"grpo_rollout_x_{uuid.uuid4().hex[:12]}"
    segments = [create_segment(name, 16) for name in (reused, mine, legacy)]
    try:
        assert creator_gone(reused) and not creator_gone(mine) and not creator_gone(legacy)
        other_id = reused.split("_")[2] + "x"
        assert reclaim_stale_segments(other_id) == []  # another rollout's: not ours to look at
        assert reclaim_stale_segments(reused.split("_")[2]) == [reused]
        assert Path("/dev/shm", mine).exists() and Path("/dev/shm", legacy).exists()
    finally:
        for segment in segments:
            segment.close()
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()


def test_segment_names_carry_their_creator_and_pass_the_name_check() -> None:
    name = segment_name("a1b2c3d4", 7)
    assert name.startswith("grpo_a1b2c3d4_") and name.endswith("_v7")
    check_segment_name(name, 7)
    check_segment_name("grpo_a1b2c3d4_v7", 7)  # a learner before creator tokens
    for bad in (name.replace("_v7", "_v8"), "grpo_a1b2c3d4_1-2-zz_v7", "grpo_../x_v7", name + "x" * 100):
        with pytest.raises(InvalidArgument):
            check_segment_name(bad, 7)
