"""Joining a weight-sync group and broadcasting over it (`process_group.py`) with real Gloo over the
learner's real TCPStore: every member is a thread of this process. The roll call decides before anyone
connects, a late member fails at once, an abort key ends everyone's wait, a connection mesh that never
forms is abandoned in bounded time, and every bucket's wait ends at its transfer deadline."""

from __future__ import annotations

import datetime
import secrets
import threading
import time

import pytest
import torch
import torch.distributed as dist

from services.transports.kinds import join_bound_s
from services.transports.process_group import (
    BroadcastAborted,
    JoinTimeout,
    SealedStore,
    TamperedKey,
    TransferTimeout,
    _bounded,
    abort,
    broadcast,
    close_group,
    connect_store,
    open_group,
    roll_call,
    serve_store,
    wait_slice,
)

pytestmark = pytest.mark.timeout(60)
NAMES = {0: "learner", 1: "rollout-a", 2: "rollout-b"}
SECRET = secrets.token_hex(16)


@pytest.fixture
def store_port():
    store, bound = serve_store("127.0.0.1", 0, 10.0)
    assert bound == "127.0.0.1"
    yield store.port
    del store


def _keys(port: int, group_id: str, broadcast_id: str = "b1") -> SealedStore:
    return connect_store("127.0.0.1", port, SECRET, group_id, 10.0).child(f"b/{broadcast_id}")


def _join(port: int, group_id: str, rank: int, world: int, timeout_s: float, results: dict) -> None:
    started = time.monotonic()
    try:
        keys = _keys(port, group_id)
        results[f"{rank}_verdict"] = roll_call(keys, group_id, rank, world, timeout_s, NAMES, lambda: "")
        group_store = connect_store("127.0.0.1", port, SECRET, group_id, 10.0)
        results[rank] = open_group("gloo", group_store, rank, world, timeout_s, "127.0.0.1", lambda: "")
    except Exception as exc:
        results[rank] = exc
    results[f"{rank}_s"] = time.monotonic() - started


def _members(port: int, group_id: str, ranks: list[int], world: int, timeout_s: float) -> dict:
    results: dict = {}
    threads = [
        threading.Thread(target=_join, args=(port, group_id, r, world, timeout_s, results)) for r in ranks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_bound_s(timeout_s) + 5)
    assert not any(t.is_alive() for t in threads), "joining must end within its bound"
    return results


def test_all_members_join_and_broadcast(store_port) -> None:
    results = _members(store_port, "ok", [0, 1, 2], 3, 5.0)
    groups = [results[r] for r in range(3)]
    assert all(isinstance(g, dist.ProcessGroupGloo) for g in groups), groups
    assert results["1_verdict"] == results["2_verdict"] == b"go"
    tensors = [torch.arange(8.0) if r == 0 else torch.zeros(8) for r in range(3)]
    until = time.monotonic() + 10
    pairs = zip(groups, tensors, strict=True)
    threads = [threading.Thread(target=broadcast, args=(g, t, until, lambda: "")) for g, t in pairs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert all(torch.equal(t, torch.arange(8.0)) for t in tensors)
    for group in groups:
        close_group(group)


def test_a_missing_member_fails_everyone_who_came_and_is_named(store_port) -> None:
    results = _members(store_port, "absent", [0, 1], 3, 1.0)
    for rank in (0, 1):
        assert isinstance(results[rank], JoinTimeout), results[rank]
        assert "rank 2 (rollout-b)" in str(results[rank])
        assert results[f"{rank}_s"] < join_bound_s(1.0) + 1
    # the learner's verdict was "abort": rollout-a was told why, not left to connect
    assert str(results[1]).endswith("rank 2 (rollout-b) did not join within 1s")


def test_a_member_arriving_after_the_verdict_fails_at_once(store_port) -> None:
    _members(store_port, "late", [0, 1], 3, 1.0)  # the group is given up on
    results = _members(store_port, "late", [2], 3, 5.0)
    assert isinstance(results[2], JoinTimeout), results[2]
    assert str(results[2]) == (
        "group late: rank 2 (rollout-b) did not join within 1s; "
        "rank 2 (rollout-b) came after the learner gave up"
    )
    assert results["2_s"] < 1.0  # no waiting for a deadline: the verdict is already there


def test_an_abort_key_ends_every_wait_of_the_roll_call_at_once(store_port) -> None:
    # rollout-b refuses the broadcast (it will not take part): the learner and rollout-a, who would
    # otherwise wait out a 30 s join deadline, stop as soon as its abort key is written
    results: dict = {}
    threads = [
        threading.Thread(target=_join, args=(store_port, "refused", r, 3, 30.0, results)) for r in (0, 1)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    abort(_keys(store_port, "refused"), "rollout-b refused: version 3 is stale")
    for thread in threads:
        thread.join(10)
    assert not any(t.is_alive() for t in threads), "a refusal must end the roll call at once"
    for rank in (0, 1):
        assert isinstance(results[rank], BroadcastAborted), results[rank]
        assert "rollout-b refused: version 3 is stale" in str(results[rank])


def test_a_member_that_gave_up_on_the_roll_call_ends_the_broadcast_for_the_learner(store_port) -> None:
    # rollout-a waits for a verdict that does not come in time (the learner is late) and leaves
    early = _members(store_port, "slow-learner", [1], 3, 0.5)
    assert isinstance(early[1], JoinTimeout) and "no roll-call verdict" in str(early[1])
    abort(_keys(store_port, "slow-learner"), f"rollout-a: {early[1]}")  # as its receive does
    # the learner arrives later: it must not count rollout-a in, nor wait its deadline out
    results = _members(store_port, "slow-learner", [0, 2], 3, 30.0)
    assert isinstance(results[0], BroadcastAborted) and "rollout-a" in str(results[0])
    assert results["0_s"] < 10


def test_a_mesh_that_never_forms_is_abandoned_and_closed_if_it_forms_later() -> None:
    release = threading.Event()
    built = threading.Event()

    class Group:
        closed = False

        def abort(self) -> None:
            Group.closed = True

    def build():
        release.wait(10)  # as Gloo's accepting side waits for a peer that will never connect
        built.set()
        return Group()

    started = time.monotonic()
    with pytest.raises(JoinTimeout, match=r"did not form within 0\.3s"):
        _bounded(build, 0.3, "stuck")
    assert time.monotonic() - started < 0.3 + 1
    assert not Group.closed
    release.set()
    assert built.wait(5)
    deadline = time.monotonic() + 5
    while not Group.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert Group.closed, "a group that formed after it was abandoned must be closed, not leaked"
    # and a mesh a member gave up on is abandoned as soon as it says so, not at the limit
    release.clear()
    with pytest.raises(BroadcastAborted, match="rollout-b left"):
        _bounded(build, 30.0, "given-up", lambda: "rollout-b left")
    release.set()


def test_a_bucket_wait_ends_at_its_deadline_or_at_an_abort(store_port) -> None:
    # the learner never sends: the member's wait ends at its deadline, or as soon as it is told why
    for group_id, until, stop, error in (
        ("deadline", 0.5, lambda: "", TransferTimeout),
        ("aborted", 30, lambda: "the learner gave up", BroadcastAborted),
    ):
        results = _members(store_port, group_id, [0, 1], 2, 20.0)
        learner, member = results[0], results[1]
        with pytest.raises(error):
            broadcast(member, torch.zeros(4), time.monotonic() + until, stop)
        started = time.monotonic()
        close_group(member)  # its collective is still pending: releasing must not wait for it
        close_group(learner)
        assert time.monotonic() - started < 5.0  # not the group's own 20 s timeout


def test_sealed_keys_cannot_be_listed_guessed_or_forged(store_port) -> None:
    keys = _keys(store_port, "sealed")
    keys.set("roll_call", "go")
    outsider = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=5))
    listed = outsider.list_keys()
    assert listed and not any("sealed" in k or "roll_call" in k or SECRET in k for k in listed), listed
    for name in listed:  # the outsider overwrites every key it can see: no member believes it
        outsider.set(name, "abort: forged")
    with pytest.raises(TamperedKey):
        keys.get("roll_call")
    other = SealedStore(outsider, secrets.token_hex(16), "sealed/").child("b/b1")  # a wrong secret
    other.set("abort", "forged")
    assert not keys.check(["abort"])


def test_the_store_listens_only_on_the_address_it_is_served_at(store_port) -> None:
    import socket

    from services.transports.process_group import local_address

    try:
        outside = local_address("192.0.2.1", 9)  # TEST-NET-1: only asks the routing table
    except OSError:
        outside = ""
    if not outside or outside.startswith("127."):
        pytest.skip("this machine has no non-loopback interface")
    with pytest.raises(OSError):
        socket.create_connection((outside, store_port), timeout=2).close()
    socket.create_connection(("127.0.0.1", store_port), timeout=2).close()


def test_a_bucket_wait_with_under_a_millisecond_left_still_ends_at_once(store_port) -> None:
    """c10d truncates a wait's timeout to milliseconds and reads 0 as "no timeout": a last slice of
    under a millisecond waited for Gloo's own 20 s timeout (the bucket-wait test above failed 2 runs
    of 8 beside two CPU hogs). `wait_slice` never asks for less than 1 ms."""
    results = _members(store_port, "sub-ms", [0, 1], 2, 20.0)
    learner, member = results[0], results[1]
    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = member.broadcast([torch.zeros(4)], options)  # the learner never sends
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        work.wait(wait_slice(0.0004))
    assert not work.is_completed()  # our slice ended, not the collective (its 20 s timeout)
    assert time.monotonic() - started < 10.0
    assert wait_slice(5.0) == datetime.timedelta(milliseconds=250)
    close_group(member)
    close_group(learner)
