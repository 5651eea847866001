"""Joining a weight-sync group (`process_group.open_group`) with real Gloo over a real TCPStore: every
member is a thread of this process. The roll call decides before anyone connects, a late member fails
at once, and a connection mesh that never forms is abandoned in bounded time."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from services.transports.kinds import join_bound_s
from services.transports.process_group import JoinTimeout, _bounded, broadcast, close_group, open_group

pytestmark = pytest.mark.timeout(60)
NAMES = {0: "learner", 1: "rollout-a", 2: "rollout-b"}


@pytest.fixture
def store_port():
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    yield store.port
    del store


def _join(port: int, group_id: str, rank: int, world: int, timeout_s: float, results: dict) -> None:
    started = time.monotonic()
    try:
        results[rank] = open_group("gloo", "127.0.0.1", port, group_id, rank, world, timeout_s, NAMES)
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
    tensors = [torch.arange(8.0) if r == 0 else torch.zeros(8) for r in range(3)]
    pairs = zip(groups, tensors, strict=True)
    threads = [threading.Thread(target=broadcast, args=(g, t, 5.0)) for g, t in pairs]
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


def test_a_member_that_gave_up_on_the_roll_call_is_not_counted_in_later(store_port) -> None:
    # rollout-a waits for a verdict that does not come in time (the learner is late) and leaves
    early = _members(store_port, "slow-learner", [1], 3, 0.5)
    assert isinstance(early[1], JoinTimeout) and "no roll-call verdict" in str(early[1])
    # the learner arrives later: it must not count rollout-a, whose joined key went with it
    results = _members(store_port, "slow-learner", [0, 2], 3, 1.0)
    assert isinstance(results[0], JoinTimeout) and "rank 1 (rollout-a)" in str(results[0])


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
