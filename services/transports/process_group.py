"""Stateless torch.distributed process groups for the collective weight transports.

A group is built directly as `ProcessGroupGloo` / `ProcessGroupNCCL` over a `PrefixStore` of the
learner's `TCPStore`, never through `init_process_group`: no default group is touched, so it coexists
with vLLM's own and with any the learner uses, and a new one can be formed (under a new `group_id`)
whenever membership changes. Every blocking step takes a timeout, so a member that never joins or dies
mid-collective fails the others instead of hanging them.

Joining has two phases, each bounded:
    roll call   every member writes `joined/<rank>`; rank 0 (the learner) waits for all of them and
                writes the verdict `roll_call` = go | abort; the others wait for the verdict. Nobody
                builds connections for a group that someone gave up on, and a member that arrives after
                the verdict "abort" fails at once instead of connecting to members that left.
    mesh        Gloo/NCCL connect every pair. Gloo's accepting side of a pair waits WITHOUT a timeout
                for its peer, so a peer that fails between the roll call and its connect would hang the
                other forever; the mesh is built in a helper thread and abandoned (JoinTimeout) when it
                takes longer than the deadline plus `MESH_SLACK_S`.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from services.common.logging import get_logger
from services.transports.kinds import MESH_SLACK_S

log = get_logger(__name__)
_GO = b"go"


class JoinTimeout(TimeoutError):
    """Some members of a weight-sync group did not join in time."""


def open_group(
    backend: str,
    address: str,
    port: int,
    group_id: str,
    rank: int,
    world: int,
    timeout_s: float,
    names: dict[int, str] | None = None,
) -> dist.ProcessGroup:
    """Join group `group_id` as `rank` of `world`: blocks until every member joined, or raises
    JoinTimeout naming the members that did not (`names`: rank → who it is). Takes at most
    `kinds.join_bound_s(timeout_s)`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"grpo/{group_id}/", store)
    _roll_call(prefixed, group_id, rank, world, timeout_s, names or {})

    def build() -> dist.ProcessGroup:
        if backend == "gloo":
            return dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)

    return _bounded(build, timeout_s + MESH_SLACK_S, group_id)


def _roll_call(
    store: dist.Store, group_id: str, rank: int, world: int, timeout_s: float, names: dict[int, str]
) -> None:
    """Phase one of joining: all members present, and rank 0 said so, or JoinTimeout. Rank 0's verdict
    is `go` or `abort: <who was missing>`, so every member's error names the absent ones."""
    timeout = datetime.timedelta(seconds=timeout_s)

    def who(rank: int) -> str:
        return f"rank {rank} ({names.get(rank, 'learner' if rank == 0 else '?')})"

    def missing() -> str:
        return ", ".join(who(r) for r in range(world) if not store.check([f"joined/{r}"]))

    store.set(f"joined/{rank}", "1")  # our own roll call, so a failure can say who is missing
    if rank == 0:
        try:
            store.wait([f"joined/{r}" for r in range(world)], timeout)
        except Exception as exc:
            reason = f"{missing()} did not join within {timeout_s:g}s"
            store.set("roll_call", f"abort: {reason}")
            raise JoinTimeout(f"group {group_id}: {reason}") from exc
        store.set("roll_call", _GO)
        return
    late = store.check(["roll_call"])  # the verdict was in before we came
    try:  # rank 0 may come up to one deadline after us and then wait its own deadline
        store.wait(["roll_call"], 2 * timeout)
    except Exception as exc:
        absent = missing()
        store.delete_key(f"joined/{rank}")  # we leave: rank 0 must not count us in later
        raise JoinTimeout(
            f"group {group_id}: no roll-call verdict from {who(0)} within {2 * timeout_s:g}s; "
            f"absent: {absent or 'none'}"
        ) from exc
    verdict = store.get("roll_call")
    if verdict != _GO:
        reason = verdict.decode(errors="replace").removeprefix("abort: ")
        arrival = f"; {who(rank)} came after the learner gave up" if late else ""
        raise JoinTimeout(f"group {group_id}: {reason}{arrival}")


def _bounded(build: Callable[[], dist.ProcessGroup], limit_s: float, group_id: str) -> dist.ProcessGroup:
    """Run `build` in a helper thread and wait at most `limit_s` for it; a group that forms after we
    gave up is closed by the helper itself."""
    lock = threading.Lock()
    outcome: list[dist.ProcessGroup | BaseException] = []
    abandoned = False

    def run() -> None:
        try:
            result: dist.ProcessGroup | BaseException = build()
        except BaseException as exc:
            result = exc
        with lock:
            if not abandoned:
                outcome.append(result)
                return
        if not isinstance(result, BaseException):
            close_group(result)

    helper = threading.Thread(target=run, name=f"grpo-mesh-{group_id}", daemon=True)
    helper.start()
    helper.join(limit_s)
    with lock:
        if not outcome:
            abandoned = True
            raise JoinTimeout(
                f"group {group_id}: the connections between members did not form within {limit_s:g}s "
                "(a member left during the join); abandoned"
            )
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def member_names(ranks: dict[str, int], world: int) -> dict[int, str]:
    """rank → "rollout-id" (or "rollout-id worker k") from the first-rank map of a group."""
    names = {0: "learner"}
    starts = sorted((rank, rollout) for rollout, rank in ranks.items())
    for (start, rollout), (end, _) in zip(starts, [*starts[1:], (world, "")], strict=True):
        for rank in range(start, end):
            names[rank] = rollout if end - start == 1 else f"{rollout} worker {rank - start}"
    return names


def close_group(group: dist.ProcessGroup | None) -> None:
    """Release a group's connections (abort, so nothing waits on a dead peer)."""
    if group is None:
        return
    for method in ("abort", "shutdown"):
        if hasattr(group, method):
            try:
                getattr(group, method)()
            except Exception as exc:  # a broken group may refuse; it is dropped either way
                log.debug("closing a weight-sync group", method=method, error=str(exc))
            return


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast `tensor` from rank 0, in place on the others; raises after `timeout_s`."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait(datetime.timedelta(seconds=timeout_s))
