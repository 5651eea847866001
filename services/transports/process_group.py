"""Stateless torch.distributed process groups for the collective weight transports, and their
rendezvous store.

The store: the learner serves one `TCPStore` (`serve_store`), bound only to the address it advertises
(127.0.0.1 when it advertises a loopback address), never on all interfaces. A TCPStore has no access
control: any client that reaches the port may read, write, delete and list keys. So every group's keys
go through a `SealedStore` keyed by a per-group secret that travels only in the PrepareWeights /
StageWeights messages: key names are HMACs of the secret (a listing shows opaque hex, from which no
other name can be derived) and every value carries an HMAC tag that readers check, so a key an outsider
wrote or overwrote is never believed (`TamperedKey`), and nobody without the secret can join a group.

A group is built directly as `ProcessGroupGloo` / `ProcessGroupNCCL` over the sealed store, never
through `init_process_group`: no default group is touched, so it coexists with vLLM's own and with any
the learner uses, and a new one is formed (under a new `group_id` and secret) whenever membership
changes. Gloo's listening sockets are bound to the address each member reaches the learner from.

Every broadcast starts with a roll call (`roll_call`): every member writes `joined/<rank>`; rank 0
(the learner) waits for all of them and writes the verdict go | abort; the others wait for the
verdict. Any member may end a broadcast for everyone at once by writing its `abort` key (`abort`):
a rollout that refuses the version, a worker that failed, a receive that was cancelled. Every wait,
in the roll call, while the connection mesh forms (`open_group`) and in each bucket (`broadcast`), is
a loop of short slices that checks that key and the caller's own `stop`, up to a deadline.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import math
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from services.common.logging import get_logger
from services.transports.kinds import MESH_SLACK_S

log = get_logger(__name__)
_GO = b"go"
_ENDED = "ended: "  # a verdict saying a member ended the broadcast (its abort key), not a deadline
_POLL_S = 0.02  # between checks of the store while waiting for the roll call
_SLICE_S = 0.25  # a bucket's wait between checks of the abort key
Stop = Callable[[], str]  # why to stop waiting now ("" = keep waiting)


class JoinTimeout(TimeoutError):
    """Some members of a weight-sync group did not join in time."""


class TransferTimeout(TimeoutError):
    """A broadcast did not finish within its transfer deadline."""


class BroadcastAborted(RuntimeError):
    """A member ended the broadcast (its `abort` key), or the caller stopped it."""


class TamperedKey(RuntimeError):
    """A rendezvous key whose value was not written by a holder of the group's secret."""


# ---------------------------------------------------------------------------------------------- store


class SealedStore(dist.Store):
    """A view of the learner's TCPStore in which names are HMAC(secret, namespace/name) and values
    carry HMAC(secret, name ‖ value); a value whose tag does not verify raises TamperedKey."""

    def __init__(self, inner: dist.Store, secret: str, namespace: str = "") -> None:
        super().__init__()
        self._inner, self._secret, self._namespace = inner, secret, namespace
        self._key = bytes.fromhex(secret)

    def child(self, namespace: str) -> SealedStore:
        return SealedStore(self._inner, self._secret, f"{self._namespace}{namespace}/")

    def _name(self, key: str) -> str:
        return hmac.new(self._key, f"n:{self._namespace}{key}".encode(), hashlib.sha256).hexdigest()[:40]

    def _tag(self, name: str, value: bytes) -> bytes:
        return hmac.new(self._key, name.encode() + b"\0" + value, hashlib.sha256).digest()

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        name = self._name(key)
        self._inner.set(name, self._tag(name, data) + data)

    def get(self, key: str) -> bytes:
        name = self._name(key)
        raw = bytes(self._inner.get(name))
        tag, data = raw[:32], raw[32:]
        if not hmac.compare_digest(tag, self._tag(name, data)):
            raise TamperedKey(f"rendezvous key {self._namespace}{key} was not written by a group member")
        return data

    def check(self, keys: list[str]) -> bool:
        return self._inner.check([self._name(k) for k in keys])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._inner.wait(names)
        else:
            self._inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(self._name(key))

    def add(self, key: str, value: int) -> int:  # counters cannot be sealed: Gloo/NCCL never use them
        raise NotImplementedError("a sealed rendezvous store keeps no counters")

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)


def _is_local(address: str) -> bool:
    """Whether this machine has `address` (it can bind a socket to it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
    except OSError:
        return False
    return True


def bind_address(host: str) -> str:
    """Where the store listens for a learner that advertises `host`: that address (a name resolved
    here), when this machine has it. All interfaces ("::") only when it cannot tell: the advertised
    address is not this machine's (a Kubernetes Service, a NAT) or it resolves here to loopback alone
    (the Debian 127.0.1.1 entry of the machine's own name, which other machines resolve elsewhere)."""
    try:
        literal: str | None = str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        literal = "127.0.0.1" if host == "localhost" else None
    if literal is not None:
        resolved = {literal}
    else:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    local = sorted(a for a in resolved if _is_local(a))
    if literal is not None and local:
        return local[0]
    outside = [a for a in local if not ipaddress.ip_address(a).is_loopback]
    if outside:
        return outside[0]
    log.warning("the rendezvous store listens on all interfaces", host=host, resolves_to=sorted(resolved))
    return "::"


def _listen(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if address == "::":
            listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
        listener.bind((address, port))
        listener.listen(128)
    except BaseException:
        listener.close()
        raise
    return listener


def serve_store(host: str, port: int, timeout_s: float) -> tuple[dist.TCPStore, str]:
    """The learner's rendezvous TCPStore, listening only on `bind_address(host)` (the store owns the
    listening socket from then on), and that address ("::" = every interface)."""
    address = bind_address(host)
    try:
        listener = _listen(address, port)
    except OSError:
        if address != "::":
            raise
        listener = _listen("0.0.0.0", port)  # a machine without IPv6
    store = dist.TCPStore(
        "127.0.0.1" if address == "::" else address, listener.getsockname()[1], is_master=True,
        wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(), use_libuv=True,
    )  # fmt: skip
    return store, address


def connect_store(address: str, port: int, secret: str, group_id: str, timeout_s: float) -> SealedStore:
    """A member's sealed view of group `group_id`'s keys in the learner's store (blocking)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    raw = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    return SealedStore(raw, secret, f"{group_id}/")


def abort(store: dist.Store, reason: str) -> None:
    """End the broadcast whose keys `store` holds for every member (first reason wins)."""
    try:
        if not store.check(["abort"]):
            store.set("abort", reason[:1000])
    except Exception as exc:  # the learner's store may be gone: nobody is waiting on it then
        log.debug("writing a broadcast's abort key", error=str(exc))


def aborted(store: dist.Store) -> str:
    """The reason a member ended this broadcast, "" if none did."""
    if not store.check(["abort"]):
        return ""
    try:
        return store.get("abort").decode(errors="replace")
    except TamperedKey as exc:
        return str(exc)


# ---------------------------------------------------------------------------------------------- joining


def roll_call(
    store: dist.Store,
    group_id: str,
    rank: int,
    world: int,
    join_s: float,
    names: dict[int, str],
    stop: Stop,
    verdict: bytes | Callable[[], bytes] = _GO,
) -> bytes:
    """All members present for this broadcast and rank 0 said so, or JoinTimeout / BroadcastAborted
    (someone wrote the abort key, or `stop` said why). Rank 0 waits `join_s` for the others and
    writes `verdict` (which starts with "go"; e.g. whether a new group's mesh follows; a callable is
    asked once everyone is present, so it may read what the members wrote first); the others wait
    up to twice that (rank 0 may come one deadline after them) and return it. A member that gives up
    takes its `joined` key back."""

    def who(r: int) -> str:
        return f"rank {r} ({names.get(r, 'learner' if r == 0 else '?')})"

    def missing() -> str:
        return ", ".join(who(r) for r in range(world) if not store.check([f"joined/{r}"]))

    limit = join_s if rank == 0 else 2 * join_s
    deadline = time.monotonic() + limit
    late = rank != 0 and store.check(["roll_call"])  # the verdict was in before we came
    store.set(f"joined/{rank}", "1")
    everyone = [f"joined/{r}" for r in range(world)]
    while True:
        if rank == 0 and store.check(everyone):
            said = verdict() if callable(verdict) else verdict
            store.set("roll_call", said)
            return said
        if rank != 0 and store.check(["roll_call"]):
            said = store.get("roll_call").decode(errors="replace")
            if said.startswith(_GO.decode()):
                return said.encode()
            if said.startswith(_ENDED):  # a member ended it: not a deadline
                raise BroadcastAborted(f"group {group_id}: {said.removeprefix(_ENDED)}")
            arrival = f"; {who(rank)} came after the learner gave up" if late else ""
            raise JoinTimeout(f"group {group_id}: {said.removeprefix('abort: ')}{arrival}")
        why = aborted(store) or stop()
        if why and rank != 0 and store.check(["roll_call"]):
            continue  # rank 0's verdict came first: it says what happened (a deadline, or who ended it)
        if why or time.monotonic() > deadline:
            if rank == 0:
                reason = why or f"{missing()} did not join within {join_s:g}s"
                store.set("roll_call", f"{_ENDED if why else 'abort: '}{reason}")
            else:
                store.delete_key(f"joined/{rank}")  # we leave: rank 0 must not count us in later
                reason = why or (
                    f"no roll-call verdict from {who(0)} within {limit:g}s; absent: {missing() or 'none'}"
                )
            if why:
                raise BroadcastAborted(f"group {group_id}: {why}")
            raise JoinTimeout(f"group {group_id}: {reason}")
        time.sleep(_POLL_S)


def local_address(master: str, port: int) -> str:
    """The address of this machine that reaches `master` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in master else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((master.strip("[]"), port))
        return probe.getsockname()[0]


def open_group(
    backend: str,
    store: SealedStore,
    rank: int,
    world: int,
    timeout_s: float,
    bind_host: str,
    stop: Stop,
    group_id: str = "",
) -> dist.ProcessGroup:
    """Build the connection mesh of a group whose roll call said go. `timeout_s` is also each
    collective's own timeout (the backstop behind `broadcast`'s deadline). Gloo listens on
    `bind_host` ("::": where Gloo's default device does). Takes at most `timeout_s + MESH_SLACK_S`,
    less when `stop` says why."""
    timeout = datetime.timedelta(seconds=timeout_s)
    mesh = store.child("mesh")

    def build() -> dist.ProcessGroup:
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            if bind_host != "::":  # else Gloo's default: the address this machine's name resolves to
                options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            else:
                options._devices = [dist.ProcessGroupGloo.create_default_device()]
            options._timeout = timeout
            return dist.ProcessGroupGloo(mesh, rank, world, options)
        nccl_options = dist.ProcessGroupNCCL.Options()
        nccl_options._timeout = timeout
        return dist.ProcessGroupNCCL(mesh, rank, world, nccl_options)

    return _bounded(build, timeout_s + MESH_SLACK_S, group_id, stop)


def _bounded(
    build: Callable[[], dist.ProcessGroup], limit_s: float, group_id: str, stop: Stop = lambda: ""
) -> dist.ProcessGroup:
    """Run `build` in a helper thread and wait at most `limit_s` for it (Gloo's accepting side of a
    pair waits for its peer without a timeout), checking `stop` as it waits; a group that forms after
    we gave up is closed by the helper itself."""
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
    deadline, why = time.monotonic() + limit_s, ""
    while helper.is_alive() and time.monotonic() < deadline and not why:
        helper.join(min(_SLICE_S, max(deadline - time.monotonic(), 0)))
        why = "" if not helper.is_alive() else stop()
    with lock:
        if not outcome:
            abandoned = True
            if why:
                raise BroadcastAborted(f"group {group_id}: {why}")
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
    """Release a group's connections. Dropping a Gloo group whose collective is still pending blocks
    until that collective's own timeout, so the last reference is dropped in a short-lived daemon
    thread: the caller (the learner's model thread, a receive) never waits for it."""
    if group is None:
        return
    for method in ("abort", "shutdown"):
        if hasattr(group, method):
            try:
                getattr(group, method)()
            except Exception as exc:  # a broken group may refuse; it is dropped either way
                log.debug("closing a weight-sync group", method=method, error=str(exc))
            break
    holder = [group]
    del group
    threading.Thread(target=holder.clear, name="grpo-group-release", daemon=True).start()


# ---------------------------------------------------------------------------------------------- transfer


def wait_slice(remaining: float) -> datetime.timedelta:
    """One wait of a bucket: at most `_SLICE_S`, in whole milliseconds and at least one. c10d truncates
    a wait's timeout to milliseconds and reads 0 as "no timeout" (the collective's own, 20-60 s): the
    last fraction of a millisecond before a deadline would otherwise wait for that instead."""
    return datetime.timedelta(milliseconds=max(1, math.ceil(min(_SLICE_S, remaining) * 1e3)))


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, deadline: float, stop: Stop) -> None:
    """Broadcast `tensor` from rank 0, in place on the others. Raises TransferTimeout once
    `time.monotonic()` passes `deadline`, BroadcastAborted as soon as `stop` says why."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    work = group.broadcast([tensor], options)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout("the broadcast did not finish within its transfer deadline")
        try:
            work.wait(wait_slice(remaining))
            return
        except RuntimeError:
            if work.is_completed():  # the collective itself failed (a peer left, its own timeout)
                raise
        if why := stop():
            raise BroadcastAborted(why)
