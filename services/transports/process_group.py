"""Stateless torch.distributed process groups for the collective weight transports.

A group is built directly as `ProcessGroupGloo` / `ProcessGroupNCCL` over a `PrefixStore` of the
learner's `TCPStore`, never through `init_process_group`: no default group is touched, so it coexists
with vLLM's own and with any the learner uses, and a new one can be formed (under a new `group_id`)
whenever membership changes. Every blocking step takes a timeout, so a member that never joins or dies
mid-collective fails the others instead of hanging them.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from services.common.logging import get_logger

log = get_logger(__name__)


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
    JoinTimeout after `timeout_s` naming the members that did not (`names`: rank → who it is)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"grpo/{group_id}/", store)
    prefixed.set(f"joined/{rank}", "1")  # our own roll call, so a failure can say who is missing
    try:
        if backend == "gloo":
            return dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, options)
    except Exception as exc:
        missing = [r for r in range(world) if not prefixed.check([f"joined/{r}"])]
        if not missing:
            raise
        who = ", ".join(f"rank {r} ({(names or {}).get(r, 'learner' if r == 0 else '?')})" for r in missing)
        raise JoinTimeout(f"group {group_id}: {who} did not join within {timeout_s:g}s") from exc


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
