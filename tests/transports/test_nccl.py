"""The nccl transport with the Gloo backend (CPU), its three halves for real: the learner's sender in
this process (as the learner's model thread would run it), receivers in threads (as worker processes
would) and, for deaths, in separate processes killed with SIGKILL. Every test has a hard time limit."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from services.common.errors import DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument
from services.transports import PublishContext, Receiver, StageContext, TransportKind, WorkerContext
from services.transports import registry as transports
from services.transports.nccl import NcclPrepared

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
NCCL = transports.get(TransportKind.nccl)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(64, 48, generator=generator),
        "model.norm.weight": torch.randn(48, generator=generator).to(torch.bfloat16),
        "lm_head.weight": torch.randn(64, 48, generator=generator),
    }


def _ctx(timeout: float = 5.0) -> PublishContext:
    return PublishContext("run", 4096, 1 << 20, lambda: "127.0.0.1:1", collective_timeout_s=timeout)


class ThreadWorkers(transports.LocalWorkers):
    """A rollout's workers as threads of this process: each has its own transport state."""

    def __init__(self, count: int = 1) -> None:
        super().__init__(*(WorkerContext({}, rank, torch.device("cpu")) for rank in range(count)))

    def load(self, staged) -> dict[str, torch.Tensor]:
        tensors = list(staged.manifest.tensors)
        loaded = []
        for worker in self.workers:
            with transports.open_tensors(staged.plan, tensors, worker) as views:
                loaded.append({name: t.clone() for name, t in views})
        assert all(
            set(d) == set(loaded[0]) and all(torch.equal(d[n], loaded[0][n]) for n in d) for d in loaded
        )
        return loaded[0]


def _publish_in_background(prepared: NcclPrepared) -> threading.Thread:
    thread = threading.Thread(target=prepared.publish, daemon=True)
    thread.start()
    return thread


async def _sync(ctx: PublishContext, state, version: int, rollouts: dict[str, ThreadWorkers]):
    """One version: prepare (learner), publish in a thread, every rollout stages concurrently."""
    receivers = tuple(Receiver(rid, f"{rid}-i", len(w.workers)) for rid, w in rollouts.items())
    prepared = NCCL.prepare(version, state, ctx, receivers)
    target = transports.target_from_proto(transports.describe(prepared))
    sender = _publish_in_background(prepared)
    staged = await asyncio.gather(
        *(NCCL.stage(target, StageContext(rid, 30, workers)) for rid, workers in rollouts.items()),
        return_exceptions=True,
    )
    sender.join(timeout=60)
    assert not sender.is_alive(), "the learner's broadcast must end (or fail) within its deadline"
    return prepared, target, staged


async def test_versions_reach_every_worker_of_every_rollout_and_the_group_is_kept() -> None:
    ctx = _ctx()
    rollouts = {"a": ThreadWorkers(1), "b": ThreadWorkers(2)}  # b: two workers (tensor parallel)
    state = _state()
    prepared, target, staged = await _sync(ctx, state, 1, rollouts)
    assert not prepared.error, prepared.error
    assert target.descriptor.world_size == 4 and target.descriptor.ranks == {"a": 1, "b": 2}
    assert target.descriptor.backend == "gloo" and target.manifest.algorithm == "xxh3_64"
    assert len(target.manifest.buckets) > 1  # several buckets through one 4 KiB staging buffer
    for rid, result in zip(rollouts, staged, strict=True):
        loaded = rollouts[rid].load(result)
        for name, tensor in state.items():
            assert torch.equal(loaded[name], tensor), (rid, name)
    first_group = target.descriptor.group_id

    state2 = {name: t + 1 for name, t in state.items()}
    prepared, target, staged = await _sync(ctx, state2, 2, rollouts)
    assert target.descriptor.group_id == first_group  # same members: the group is kept
    assert torch.equal(rollouts["b"].load(staged[1])["lm_head.weight"], state2["lm_head.weight"])

    rollouts["c"] = ThreadWorkers(1)  # a rollout joins: a new group
    prepared, target, staged = await _sync(ctx, state, 3, rollouts)
    assert target.descriptor.group_id != first_group and target.descriptor.world_size == 5
    assert all(not isinstance(s, BaseException) for s in staged), staged


async def test_a_version_prepared_again_is_broadcast_again_not_answered_from_the_last_receipt() -> None:
    # A re-sync of the version the rollouts already hold (no train step in between) is a new
    # PrepareWeights: a new broadcast the learner will send, so every worker must receive it again.
    ctx = _ctx()
    rollouts = {"a": ThreadWorkers(1)}
    state = _state()
    first, target, _ = await _sync(ctx, state, 7, rollouts)
    changed = {name: t * 2 for name, t in state.items()}  # the learner's bytes could differ
    second, target2, staged = await _sync(ctx, changed, 7, rollouts)
    assert target2.descriptor.group_id == target.descriptor.group_id  # same group
    assert target2.descriptor.broadcast_id != target.descriptor.broadcast_id
    assert not first.error and not second.error, (first.error, second.error)
    assert torch.equal(rollouts["a"].load(staged[0])["lm_head.weight"], changed["lm_head.weight"])


async def test_a_member_that_never_joins_fails_the_version_in_time_and_the_group_is_rebuilt() -> None:
    ctx = _ctx(timeout=2.0)
    state = _state()
    present = ThreadWorkers(1)
    receivers = (Receiver("present", "p", 1), Receiver("ghost", "g", 1))  # the ghost never stages
    prepared = NCCL.prepare(1, state, ctx, receivers)
    target = transports.target_from_proto(transports.describe(prepared))
    sender = _publish_in_background(prepared)
    started = time.monotonic()
    with pytest.raises(
        DeadlineExceeded,
        match=r"receiving weight version 1 failed: .*rank 1 \(ghost\) did not join within 2s",
    ):
        await NCCL.stage(target, StageContext("present", 30, present))
    elapsed = time.monotonic() - started
    sender.join(timeout=30)
    assert elapsed < 2.0 + 3.0 and not sender.is_alive()
    assert prepared.error and prepared.group.broken
    # the next version, without the ghost, builds a new group and arrives
    prepared2, target2, staged = await _sync(ctx, state, 2, {"present": present})
    assert target2.descriptor.group_id != target.descriptor.group_id and not prepared2.error
    assert torch.equal(present.load(staged[0])["lm_head.weight"], state["lm_head.weight"])


async def test_a_corrupted_bucket_is_data_loss_and_nothing_is_loadable() -> None:
    ctx = _ctx()
    state = _state()
    worker = ThreadWorkers(1)
    prepared = NCCL.prepare(1, state, ctx, (Receiver("r", "i", 1),))
    message = transports.describe(prepared)
    message.buckets[1].digest = "0" * 16
    target = transports.target_from_proto(message)
    sender = _publish_in_background(prepared)
    with pytest.raises(DataLoss, match="bucket 1 checksum mismatch"):
        await NCCL.stage(target, StageContext("r", 30, worker))
    sender.join(timeout=30)
    with (
        pytest.raises(FailedPrecondition, match="was not received"),
        transports.open_tensors(
            transports.LoadPlan(
                TransportKind.nccl, {"version": 1, "broadcast_id": target.descriptor.broadcast_id}
            ),
            [],
            worker.workers[0],
        ),
    ):
        pass


def test_bad_requests_are_refused_precisely() -> None:
    with pytest.raises(InvalidArgument, match="needs the receiving rollouts"):
        NCCL.prepare(1, _state(), _ctx(), ())
    with pytest.raises(InvalidArgument, match="distinct rollout ids"):
        NCCL.prepare(1, _state(), _ctx(), (Receiver("a", "1", 1), Receiver("a", "2", 1)))
    prepared = NCCL.prepare(1, _state(), _ctx(), (Receiver("a", "1", 1),))
    message = transports.describe(prepared)
    prepared.close()
    message.nccl.ranks["a"] = 7  # outside [1, world_size)
    with pytest.raises(InvalidArgument, match="must lie in"):
        transports.target_from_proto(message)
    message.nccl.ranks["a"], message.nccl.broadcast_id = 1, ""
    with pytest.raises(InvalidArgument, match="needs a group_id, a broadcast_id"):
        transports.target_from_proto(message)
    with pytest.raises(FailedPrecondition, match="not a member"):
        asyncio.run(
            NCCL.stage(
                transports.target_from_proto(transports.describe(prepared)),
                StageContext("b", 1, ThreadWorkers()),
            )
        )


_RECEIVER_PROCESS = """
import asyncio, sys, torch
from grpo.common.v1 import types_pb2
from services.transports import StageContext, WorkerContext
from services.transports import registry as transports
message = types_pb2.WeightVersion.FromString(sys.stdin.buffer.read())
target = transports.target_from_proto(message)
worker = WorkerContext({}, 0, torch.device("cpu"))
class Workers:
    async def call_workers(self, kind, op, spec):
        return [transports.worker_op(kind, op, spec, worker)]
print("receiving", flush=True)
try:
    asyncio.run(transports.get(target.kind).stage(target, StageContext(sys.argv[1], 60, Workers())))
    print("staged", flush=True)
except Exception as exc:
    print(f"failed {type(exc).__name__}: {exc}", flush=True)
"""


async def test_a_receiver_killed_mid_transfer_fails_the_others_within_the_deadline() -> None:
    ctx = _ctx(timeout=3.0)
    big = {f"layer{i}.weight": torch.randn(256, 256) for i in range(32)}  # 8 MiB in 4 KiB buckets
    receivers = (Receiver("victim", "v", 1), Receiver("survivor", "s", 1))
    prepared = NCCL.prepare(1, big, ctx, receivers)
    wire = transports.describe(prepared).SerializeToString()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {}
    for rid in ("victim", "survivor"):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _RECEIVER_PROCESS, rid, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, env=env, cwd=ROOT,
        )  # fmt: skip
        proc.stdin.write(wire)
        proc.stdin.close()
        assert (await asyncio.wait_for(proc.stdout.readline(), 120)).strip() == b"receiving"
        procs[rid] = proc
    sender = _publish_in_background(prepared)
    await asyncio.sleep(0.3)  # both joined or joining; 2048 buckets are in flight
    procs["victim"].send_signal(signal.SIGKILL)
    started = time.monotonic()
    out = await asyncio.wait_for(procs["survivor"].stdout.read(), 60)
    elapsed = time.monotonic() - started
    await asyncio.wait_for(procs["survivor"].wait(), 10)
    await asyncio.wait_for(procs["victim"].wait(), 10)
    sender.join(timeout=60)
    assert not sender.is_alive() and prepared.error and prepared.group.broken
    # the victim's death ends the broadcast for the survivor: a peer left (Aborted: the survivor
    # itself is sound), or at worst a deadline ran out
    assert out.decode().startswith(
        (
            "failed Aborted: receiving weight version 1 failed: survivor (rank 1)",
            "failed DeadlineExceeded: receiving weight version 1 failed: survivor (rank 1)",
        )
    ), out
    assert elapsed < 3.0 * 3 + 10  # a few deadlines at most, never a hang
    # the survivor alone gets the next version through a new group
    prepared2, target2, _ = await _sync(ctx, _state(), 2, {"survivor": ThreadWorkers(1)})
    assert not prepared2.error and target2.descriptor.group_id != prepared.group.group_id
