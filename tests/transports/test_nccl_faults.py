"""The nccl transport (Gloo on CPU) when a member will not or cannot take part, and against an outsider
who can reach the learner's rendezvous store but was not given the group's secret: the learner's real
store and Gloo groups, receivers as threads (`test_nccl.ThreadWorkers`). Bounds in these tests are a
fraction of the collective deadline they are about, never wall-clock performance."""

from __future__ import annotations

import asyncio
import datetime
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from services.common.errors import Aborted, FailedPrecondition
from services.transports import Receiver, StageContext
from services.transports import registry as transports
from services.transports.kinds import receive_bound_s
from tests.transports.test_nccl import NCCL, ThreadWorkers, _ctx, _publish_in_background, _state, _sync

pytestmark = pytest.mark.timeout(120)
DEADLINE = 30.0  # every test below must end long before a member would give up waiting


def _outside_address() -> str:
    """This machine's address on its default route ("" if none): a UDP connect sends no packet."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: only the routing table is asked
        except OSError:
            return ""
        return probe.getsockname()[0]


class RefusingWorkers(ThreadWorkers):
    """A rollout whose worker fails before the rendezvous (it never joins)."""

    async def call_workers(self, kind, op, spec):
        if op == "receive":
            raise FailedPrecondition("worker 0 failed: CUDA error: out of memory")
        return await super().call_workers(kind, op, spec)


async def _receiving(workers: ThreadWorkers, broadcast_id: str) -> threading.Thread:
    """The worker's receive thread, once it is waiting for the roll call."""
    for _ in range(500):
        receiver = workers.workers[0].state.get("nccl")
        if receiver is not None and receiver.receipt and receiver.receipt.broadcast_id == broadcast_id:
            return receiver.thread
        await asyncio.sleep(0.01)
    raise AssertionError("the receive never started")


async def test_a_member_that_refuses_ends_the_learners_broadcast_at_once() -> None:
    ctx = _ctx(timeout=DEADLINE)
    rollouts = {"a": ThreadWorkers(1), "refuser": RefusingWorkers(1)}
    receivers = tuple(Receiver(rid, f"{rid}-i", 1) for rid in rollouts)
    prepared = NCCL.prepare(1, _state(), ctx, receivers)
    target = transports.target_from_proto(transports.describe(prepared))
    sender = _publish_in_background(prepared)  # the learner's model thread
    staged = await asyncio.gather(
        *(NCCL.stage(target, StageContext(rid, 30, w)) for rid, w in rollouts.items()), return_exceptions=True
    )
    sender.join(DEADLINE / 3)
    assert not sender.is_alive(), "a refusal must free the learner's model thread, not hold it a deadline"
    assert "refuser refused: FailedPrecondition: worker 0 failed" in prepared.error, prepared.error
    assert prepared.group.broken
    assert isinstance(staged[1], FailedPrecondition), staged[1]
    assert isinstance(staged[0], Aborted) and "refuser refused" in str(staged[0]), staged[0]
    # the next version, without the refuser, arrives through a new group
    prepared2, target2, result = await _sync(ctx, _state(), 2, {"a": rollouts["a"]})
    assert not prepared2.error and target2.descriptor.group_id != target.descriptor.group_id
    assert not isinstance(result[0], BaseException), result[0]


async def test_a_receive_that_cannot_finish_is_superseded_by_the_next_versions() -> None:
    # version 1 is described but never broadcast (the learner gave up on it): its receive waits for a
    # roll call that will not come. Version 2's StageWeights must not be refused "still receiving".
    ctx = _ctx(timeout=DEADLINE)
    workers = ThreadWorkers(1)
    receivers = (Receiver("r", "r-i", 1),)
    stuck = NCCL.prepare(1, _state(), ctx, receivers)
    stuck_target = transports.target_from_proto(transports.describe(stuck))
    first = asyncio.create_task(NCCL.stage(stuck_target, StageContext("r", 30, workers)))
    old_thread = await _receiving(workers, stuck.broadcast_id)
    prepared, _, staged = await _sync(ctx, _state(seed=1), 2, {"r": workers})
    assert not prepared.error, prepared.error
    assert torch.equal(workers.load(staged[0])["lm_head.weight"], _state(seed=1)["lm_head.weight"])
    with pytest.raises(Aborted, match="superseded by weight version 2"):
        await asyncio.wait_for(first, 10)
    assert not old_thread.is_alive()
    stuck.close()


async def test_a_cancelled_stage_ends_its_workers_receive() -> None:
    # the scheduler's StageWeights deadline cancels the call: the worker must stop waiting (and free
    # the group) instead of answering "still receiving" for two deadlines
    ctx = _ctx(timeout=DEADLINE)
    workers = ThreadWorkers(1)
    stuck = NCCL.prepare(1, _state(), ctx, (Receiver("r", "r-i", 1),))
    target = transports.target_from_proto(transports.describe(stuck))
    task = asyncio.create_task(NCCL.stage(target, StageContext("r", 30, workers)))
    thread = await _receiving(workers, stuck.broadcast_id)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.to_thread(thread.join, DEADLINE / 3)
    assert not thread.is_alive(), "a cancelled receive must end"
    receipt = workers.workers[0].state["nccl"].receipt
    assert receipt.status == "failed" and receipt.kind == "aborted", receipt
    stuck.close()


async def test_an_outsider_without_the_secret_cannot_affect_a_broadcast() -> None:
    ctx = _ctx(timeout=DEADLINE)
    rollouts = {"a": ThreadWorkers(1), "b": ThreadWorkers(1)}
    receivers = tuple(Receiver(rid, f"{rid}-i", 1) for rid in rollouts)
    prepared = NCCL.prepare(1, _state(), ctx, receivers)
    message = transports.describe(prepared)
    d = message.nccl
    # the outsider reaches the store and knows everything but the secret (group ids are logged)
    outsider = dist.TCPStore(
        d.master_address, d.master_port, is_master=False, timeout=datetime.timedelta(seconds=5)
    )
    forged = []
    guesses = (
        f"grpo/{d.group_id}/",
        f"grpo/{d.group_id}//",
        f"{d.group_id}/",
        f"{d.group_id}/b/{d.broadcast_id}/",
    )
    for prefix in (*guesses, ""):
        for key in ("roll_call", "abort", *(f"joined/{r}" for r in range(4))):
            outsider.set(prefix + key, "abort: forged by an outsider")
            forged.append(prefix + key)
    target = transports.target_from_proto(message)
    sender = _publish_in_background(prepared)
    staged = await asyncio.gather(
        *(NCCL.stage(target, StageContext(rid, 30, w)) for rid, w in rollouts.items()), return_exceptions=True
    )
    sender.join(DEADLINE)
    assert not prepared.error, prepared.error
    assert all(not isinstance(s, BaseException) for s in staged), staged
    for rid, result in zip(rollouts, staged, strict=True):
        assert torch.equal(rollouts[rid].load(result)["lm_head.weight"], _state()["lm_head.weight"])
    # nothing it can list names the group, the broadcast or the secret
    listed = [k for k in outsider.list_keys() if k not in forged]
    assert listed, "the group's keys are in the store"
    for word in (d.group_id, d.broadcast_id, d.secret, "roll_call", "joined", "grpo"):
        assert not any(word in key for key in listed), (word, listed)


def test_the_rendezvous_store_listens_only_where_it_is_advertised() -> None:
    prepared = NCCL.prepare(1, _state(), _ctx(), (Receiver("a", "1", 1),))  # advertised: 127.0.0.1
    port = transports.describe(prepared).nccl.master_port
    prepared.close()
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    outside = _outside_address()
    if not outside or outside.startswith("127."):
        pytest.skip("this machine has no non-loopback interface")
    with pytest.raises(OSError):
        socket.create_connection((outside, port), timeout=5).close()


def test_the_descriptor_carries_a_secret_per_group_and_a_transfer_deadline_by_bytes() -> None:
    ctx = _ctx(timeout=7.0)
    one = transports.describe(NCCL.prepare(1, _state(), ctx, (Receiver("a", "1", 1),)))
    again = transports.describe(NCCL.prepare(2, _state(), ctx, (Receiver("a", "1", 1),)))
    other = transports.describe(NCCL.prepare(3, _state(), ctx, (Receiver("b", "1", 1),)))
    assert len(one.nccl.secret) == 32 and one.nccl.secret == again.nccl.secret  # the group is kept
    assert other.nccl.secret != one.nccl.secret  # a new group, a new secret
    assert one.nccl.deadline_seconds == 7.0 and one.nccl.transfer_floor_s == 7.0
    rate = one.nccl.transfer_min_rate_mb_s
    bigger = type(one)()
    bigger.CopyFrom(one)
    bigger.total_bytes = one.total_bytes + 10**9
    assert receive_bound_s(bigger) - receive_bound_s(one) == pytest.approx(1e9 / (rate * 1e6))
    started = time.monotonic()
    assert receive_bound_s(one) < 4 * 7.0 + 7.0 + 10 and time.monotonic() - started < 1


async def test_a_rollout_that_refuses_the_version_ends_the_learners_broadcast_at_once() -> None:
    """A rollout's stager refuses a version it holds already (`not newer`): the refusal must reach the
    group at once, not leave the learner's model thread waiting for it a join deadline."""
    from services.common.deadlines import TransferDeadline
    from services.rollout.weight_sync import WeightStager

    ctx = _ctx(timeout=DEADLINE)
    rollouts = {"a": ThreadWorkers(1), "holder": ThreadWorkers(1)}
    receivers = tuple(Receiver(rid, f"{rid}-i", 1) for rid in rollouts)
    prepared = NCCL.prepare(1, _state(), ctx, receivers)
    target = transports.target_from_proto(transports.describe(prepared))
    sender = _publish_in_background(prepared)
    stager = WeightStager("holder", TransferDeadline(floor_s=30), rollouts["holder"])
    staged = await asyncio.gather(
        NCCL.stage(target, StageContext("a", 30, rollouts["a"])),
        stager.stage(target, current_version=1),  # it holds version 1 already
        return_exceptions=True,
    )
    sender.join(DEADLINE / 3)
    assert not sender.is_alive(), "a refusal must free the learner's model thread, not hold it a deadline"
    assert isinstance(staged[1], Aborted) and "not newer" in str(staged[1]), staged[1]
    assert "holder refused: weight version 1 is not newer" in prepared.error, prepared.error
    assert isinstance(staged[0], Aborted), staged[0]
