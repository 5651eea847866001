"""`nccl`: a broadcast from the learner (rank 0) to every rollout worker over a dedicated process group:
NCCL between CUDA devices, Gloo on CPU, one code path on every machine.

    learner   on its model thread: plans the packed layout, packs each bucket into ONE reusable staging
              buffer (bucket-sized, on the learner's device) to checksum it, answers PrepareWeights,
              then (`publish`, still on the model thread, so no optimizer step can interleave) holds
              the roll call, and packs and broadcasts bucket after bucket from the same buffer. The
              model's own tensors are read (no snapshot copy).
    rollout   asks every engine worker to receive (`worker_op("receive")` starts a thread there) and
              polls them until all verified their checksums, or one failed, or the deadline passed;
              when it refuses or gives up, it ends the broadcast for the whole group (its abort key)
              and cancels its workers' receives
    engine    each worker answers the roll call, joins a new group, receives every bucket into its own
              receive buffer (kept across versions), verifies it on its device, and loads from views of
              it on commit

Sparse deltas (bf16/fp16 weights, `publish.delta`): buckets as deltas against the last version packed,
when every member holds it (`nccl_delta.py`).

The group is a stateless process group over the learner's rendezvous store (`process_group.py`: the
store listens only on the advertised address and every key is sealed with the group's secret). It is
kept across versions and rebuilt under a new `group_id` and secret when its membership changes (a
rollout joins, leaves or restarts) or it broke.

Deadlines: each broadcast's roll call and a new group's connections have `deadline_seconds`; the
buckets together have `TransferDeadline.for_bytes(total_bytes)` (floor + bytes / slowest rate). Every
wait is a loop of short slices that also watches the broadcast's abort key, so a member that refuses,
fails or is cancelled ends the broadcast for everyone at once; a member that never comes fails it
within the join deadline. Either way the group is marked broken and the next version (or the
scheduler's retry) builds a new one. A receive that is cancelled or superseded by the next version's
ends within a slice and releases its group (without waiting for Gloo's own timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grpo.common.v1 import types_pb2
from services.common import checksums, weights
from services.common.checksums import ChecksumAlgorithm
from services.common.deadlines import TransferDeadline
from services.common.errors import (
    Aborted,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    GrpoError,
    InvalidArgument,
    Unavailable,
)
from services.common.logging import get_logger
from services.transports import nccl_delta
from services.transports.base import (
    LoadPlan,
    Prepared,
    PublishContext,
    Receiver,
    StageContext,
    Staged,
    StageTarget,
    TransportKind,
    WeightTransport,
    WorkerContext,
)
from services.transports.kinds import collective_receive_s, transfer_deadline
from services.transports.nccl_worker import NcclWorker, op_timeout_s
from services.transports.process_group import (
    SealedStore,
    abort,
    aborted,
    broadcast,
    close_group,
    connect_store,
    member_names,
    open_group,
    roll_call,
    serve_store,
)

log = get_logger(__name__)
_POLL_SECONDS = 0.02
_NOTICE_S = 5.0  # connecting to the store to end a broadcast we refuse (best effort)


@dataclass(frozen=True)
class NcclDescriptor:
    master_address: str
    master_port: int
    world_size: int
    ranks: dict[str, int]  # rollout id -> rank of its first worker
    group_id: str
    deadline_seconds: float
    backend: str  # "nccl" or "gloo"
    broadcast_id: str  # this one PrepareWeights' broadcast (a version may be broadcast again)
    secret: str = field(repr=False)  # seals the group's store keys; never logged
    transfer: TransferDeadline
    delta_base: str = ""  # nccl_delta.holding of the deltas' base ("": no deltas)
    bucket_deltas: tuple[nccl_delta.BucketDelta, ...] = ()  # one per bucket when delta_base is set

    def store(self, timeout_s: float) -> SealedStore:
        """This broadcast's sealed keys in the learner's store (connects: blocking)."""
        group = connect_store(self.master_address, self.master_port, self.secret, self.group_id, timeout_s)
        return group.child(f"b/{self.broadcast_id}")


def _algorithm(device: torch.device) -> ChecksumAlgorithm:
    """Checksums are computed where the bytes are: on the GPU for NCCL, on the host for Gloo."""
    return ChecksumAlgorithm.wsum64 if device.type == "cuda" else ChecksumAlgorithm.xxh3_64


def _transfer(ctx: PublishContext) -> TransferDeadline:
    """The buckets' deadline: `PublishContext.collective_transfer` where the learner sets one, else
    the default rate over a floor of `collective_timeout_s`."""
    return ctx.collective_transfer or TransferDeadline(floor_s=ctx.collective_timeout_s)


# ---------------------------------------------------------------------------------------------- learner


@dataclass
class _Group:
    group_id: str
    members: tuple[Receiver, ...]
    ranks: dict[str, int]
    world_size: int
    backend: str
    store: SealedStore
    secret: str = field(repr=False)
    handle: dist.ProcessGroup | None = None
    broken: bool = False


class _Sender:
    """The learner's side: its rendezvous store, current group and staging buffer (kept across versions)."""

    def __init__(self, ctx: PublishContext) -> None:
        self.address = ctx.advertise_address().rpartition(":")[0]  # the host rollouts reach us at
        self.store, self.bound = serve_store(self.address, ctx.collective_port, ctx.collective_timeout_s)
        self.timeout_s = ctx.collective_timeout_s
        self.transfer = _transfer(ctx)
        self.bucket_bytes = ctx.bucket_bytes
        self.group: _Group | None = None
        self.staging: torch.Tensor | None = None
        self.base: nccl_delta.Base | None = None  # the last version packed (`publish.delta`)
        self.lock = threading.Lock()

    def group_for(self, receivers: tuple[Receiver, ...], backend: str) -> _Group:
        """The current group if its membership is `receivers` and it is sound, else a new one."""
        members = tuple(sorted(receivers, key=lambda r: r.rollout_id))
        group = self.group
        if group is not None and group.members == members and group.backend == backend and not group.broken:
            return group
        if group is not None:
            close_group(group.handle)
            group.handle = None
        ranks, next_rank = {}, 1
        for member in members:
            ranks[member.rollout_id] = next_rank
            next_rank += member.workers
        group_id, secret = uuid.uuid4().hex[:12], secrets.token_hex(16)
        sealed = SealedStore(self.store, secret, f"{group_id}/")
        self.group = _Group(group_id, members, ranks, next_rank, backend, sealed, secret)
        log.info("weight-sync group formed", group_id=group_id, world_size=next_rank, ranks=ranks)
        return self.group

    def staging_for(self, size: int, device: torch.device) -> torch.Tensor:
        """The bucket staging buffer: allocated once, reallocated only when it must grow or move."""
        if self.staging is None or self.staging.numel() < size or self.staging.device != device:
            self.staging = torch.empty(size, dtype=torch.uint8, device=device)
        return self.staging


class NcclPrepared(Prepared):
    kind = TransportKind.nccl

    def __init__(
        self,
        version: int,
        manifest: weights.Manifest,
        sender: _Sender,
        group: _Group,
        state: Mapping[str, torch.Tensor],
        entries: list[weights.TensorEntry],
        device: torch.device,
        base: nccl_delta.Base | None = None,
        deltas: tuple[nccl_delta.BucketDelta, ...] = (),
    ) -> None:
        super().__init__(version, manifest)
        self.sender, self.group, self.device = sender, group, device
        self._state: Mapping[str, torch.Tensor] | None = state
        self._entries = entries
        self.delta_base = base.named if base is not None else None  # (version, base digest)
        self.deltas = deltas  # sent only if every member holds `delta_base` (the roll call says)
        self.broadcast_id = uuid.uuid4().hex[:12]
        self.error = ""

    @property
    def descriptor(self) -> NcclDescriptor:
        group, sender = self.group, self.sender
        return NcclDescriptor(
            sender.address, sender.store.port, group.world_size, dict(group.ranks), group.group_id,
            sender.timeout_s, group.backend, self.broadcast_id, group.secret, sender.transfer,
            nccl_delta.holding(*self.delta_base) if self.delta_base else "",
            tuple(d.described() for d in self.deltas),
        )  # fmt: skip

    def view(self) -> memoryview:
        raise FailedPrecondition(
            f"weight version {self.version} is broadcast over nccl; it has no byte buffer"
        )

    def publish(self) -> None:
        """Hold the roll call, join a new group, broadcast every bucket. On failure the broadcast is
        ended for every member (its abort key) and the group is marked broken; never raises."""
        state, self._state = self._state, None  # the model's own tensors: never held past this call
        if state is None:
            return
        group, sender = self.group, self.sender
        keys = group.store.child(f"b/{self.broadcast_id}")
        names = member_names(group.ranks, group.world_size)
        started = time.perf_counter()
        sent = 0
        try:
            with sender.lock:
                new = group.handle is None

                def verdict() -> bytes:
                    delta = self.delta_base is not None and nccl_delta.every_member_holds(
                        keys, group.world_size, nccl_delta.holding(*self.delta_base)
                    )
                    return b" ".join([b"go"] + [b"mesh"] * new + [b"delta"] * delta)

                said = roll_call(keys, group.group_id, 0, group.world_size, sender.timeout_s, names,
                                 lambda: "", verdict=verdict)  # fmt: skip
                deltas = self.deltas if b"delta" in said.split() else (None,) * len(self.manifest.buckets)
                if new:
                    op_timeout = op_timeout_s(sender.timeout_s, sender.transfer, sender.bucket_bytes)
                    group.handle = open_group(
                        group.backend, group.store, 0, group.world_size, op_timeout,
                        sender.bound, lambda: aborted(keys), group.group_id,
                    )  # fmt: skip
                staging = sender.staging_for(max(b.nbytes for b in self.manifest.buckets), self.device)
                until = time.monotonic() + sender.transfer.for_bytes(self.manifest.total_bytes)
                for bucket, delta in zip(self.manifest.buckets, deltas, strict=True):
                    if delta is not None and delta.payload is not None:
                        data = delta.payload
                    else:
                        data = weights.pack_range(
                            state, self._entries, bucket.offset, staging[: bucket.nbytes]
                        )
                    if data.numel():  # an unchanged bucket's delta is empty: nothing to send
                        broadcast(group.handle, data, until, lambda: aborted(keys))
                    sent += data.numel()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            abort(keys, f"learner (rank 0): {self.error}")
            group.broken = True
            close_group(group.handle)
            group.handle = None
            log.warning(
                "weight broadcast failed", version=self.version, group_id=group.group_id, error=self.error
            )
            return
        log.info(
            "weights broadcast",
            version=self.version,
            group_id=group.group_id,
            bytes=sent,
            version_bytes=self.manifest.total_bytes,
            ms=round((time.perf_counter() - started) * 1e3, 1),
        )

    def close(self) -> None:
        self._state = None
        self.deltas = tuple(d.described() for d in self.deltas)  # the payloads go


# ---------------------------------------------------------------------------------------------- transport


class CollectiveStaged(Staged):
    """A version every worker of this rollout received and verified; the bytes stay in the workers."""

    def __init__(self, version: int, manifest: weights.Manifest, fetch_ms: float, broadcast_id: str) -> None:
        super().__init__(version, manifest, fetch_ms)
        self.broadcast_id = broadcast_id

    @property
    def plan(self) -> LoadPlan:
        return LoadPlan(TransportKind.nccl, {"version": self.version, "broadcast_id": self.broadcast_id})

    def release(self) -> None:
        """Nothing to free: each worker's receive buffer is reused by the next version."""


_FAILURES: dict[str, type[GrpoError]] = {
    "deadline": DeadlineExceeded,
    "data_loss": DataLoss,
    "aborted": Aborted,
}


class NcclTransport(WeightTransport):
    kind = TransportKind.nccl
    live_state = True

    # ---- learner half
    def prepare(
        self,
        version: int,
        state: Mapping[str, torch.Tensor],
        ctx: PublishContext,
        receivers: tuple[Receiver, ...] = (),
    ) -> Prepared:
        if not receivers:
            raise InvalidArgument(
                "the nccl transport needs the receiving rollouts (PrepareWeightsRequest.receivers)"
            )
        for receiver in receivers:
            if receiver.workers < 1 or not receiver.rollout_id:
                raise InvalidArgument(
                    f"receiver {receiver.rollout_id!r} must have an id and at least one worker"
                )
        if len({r.rollout_id for r in receivers}) != len(receivers):
            raise InvalidArgument("receivers must have distinct rollout ids")
        sender = ctx.state.get("nccl")
        if sender is None:
            sender = ctx.state["nccl"] = _Sender(ctx)
        device = next(iter(state.values())).device
        backend = "nccl" if device.type == "cuda" else "gloo"
        group = sender.group_for(receivers, backend)
        entries = weights.plan_layout(state)
        total = weights.packed_size(entries)
        algorithm = _algorithm(device)
        staging = sender.staging_for(min(ctx.bucket_bytes, total), device)
        ranges = list(weights.bucket_ranges(total, ctx.bucket_bytes))
        keep = ctx.delta and nccl_delta.delta_eligible(entries, total)
        base, sender.base = sender.base, None  # rewritten bucket by bucket below
        if base is not None and not (keep and base.fits(entries, ranges) and base.buffer.device == device):
            base = None
        copy = (
            base.buffer
            if base is not None
            else torch.empty(total, dtype=torch.uint8, device=device)
            if keep
            else None
        )
        buckets, deltas = [], []
        for index, start, size in ranges:
            data = weights.pack_range(state, entries, start, staging[:size])
            buckets.append(weights.BucketEntry(index, start, size, checksums.digest(algorithm, data)))
            if base is not None:
                deltas.append(nccl_delta.encode(base, start, data))  # before the copy overwrites it
            if copy is not None:
                copy[start : start + size].copy_(data)
        manifest = weights.Manifest(tuple(entries), tuple(buckets), total, algorithm)
        prepared = NcclPrepared(version, manifest, sender, group, state, entries, device, base, tuple(deltas))
        if copy is not None:
            sender.base = nccl_delta.Base(version, manifest, copy)
        return prepared

    def write_descriptor(self, prepared: Prepared, message: types_pb2.WeightVersion) -> None:
        assert isinstance(prepared, NcclPrepared)
        d = prepared.descriptor
        out = message.nccl
        out.master_address, out.master_port, out.world_size = d.master_address, d.master_port, d.world_size
        out.ranks.update(d.ranks)
        out.group_id, out.deadline_seconds, out.backend = d.group_id, d.deadline_seconds, d.backend
        out.broadcast_id, out.secret = d.broadcast_id, d.secret
        out.transfer_floor_s, out.transfer_min_rate_mb_s = d.transfer.floor_s, d.transfer.min_rate_mb_s
        if prepared.delta_base is not None:
            message.delta_base_version, message.delta_base_digest = prepared.delta_base
            out.bucket_deltas.extend(
                types_pb2.NcclBucketDelta(encoding=int(b.encoding), payload_bytes=b.payload_bytes)
                for b in d.bucket_deltas
            )

    # ---- rollout half
    def read_descriptor(self, message: types_pb2.WeightVersion) -> NcclDescriptor:
        f = message.nccl
        if not f.master_address or not f.master_port:
            raise InvalidArgument("weight_version.nccl needs master_address and master_port")
        if not f.group_id or not f.broadcast_id or f.backend not in ("nccl", "gloo"):
            raise InvalidArgument(
                "weight_version.nccl needs a group_id, a broadcast_id and backend nccl|gloo, "
                f"got {f.backend!r}"
            )
        if not f.deadline_seconds > 0 or f.transfer_floor_s < 0 or f.transfer_min_rate_mb_s < 0:
            raise InvalidArgument("weight_version.nccl deadlines must be > 0")
        ranks = dict(f.ranks)
        if any(not 1 <= rank < f.world_size for rank in ranks.values()):
            raise InvalidArgument(f"weight_version.nccl ranks {ranks} must lie in [1, {f.world_size})")
        return NcclDescriptor(
            f.master_address, f.master_port, f.world_size, ranks, f.group_id, f.deadline_seconds, f.backend,
            f.broadcast_id, f.secret, transfer_deadline(f.transfer_floor_s, f.transfer_min_rate_mb_s),
            *nccl_delta.from_proto(message),
        )  # fmt: skip

    async def refuse(self, target: StageTarget, reason: str) -> None:
        """End `target`'s broadcast for its whole group at once (this member will not take part):
        the learner and the other members stop waiting for it. Best effort, bounded; never raises."""
        d: NcclDescriptor = target.descriptor

        def write() -> None:
            abort(d.store(_NOTICE_S), reason)

        try:
            await asyncio.wait_for(asyncio.to_thread(write), _NOTICE_S + 1)
        except Exception as exc:
            log.warning("could not end a refused broadcast", group_id=d.group_id, error=str(exc))

    async def stage(self, target: StageTarget, ctx: StageContext) -> Staged:
        d: NcclDescriptor = target.descriptor
        if ctx.rollout_id not in d.ranks:
            raise FailedPrecondition(
                f"rollout {ctx.rollout_id!r} is not a member of weight-sync group {d.group_id}"
            )
        if len(d.secret) != 32 or any(c not in "0123456789abcdef" for c in d.secret):
            raise InvalidArgument("weight_version.nccl.secret must be 32 lowercase hex digits")
        if ctx.workers is None:
            await self.refuse(target, f"{ctx.rollout_id}: its engine has no workers that can receive")
            raise FailedPrecondition("the nccl transport needs an engine whose workers can receive")
        started = time.perf_counter()
        spec = {
            "version": target.version,
            "broadcast_id": d.broadcast_id,
            "group_id": d.group_id,
            "backend": d.backend,
            "master_address": d.master_address,
            "master_port": d.master_port,
            "world_size": d.world_size,
            "ranks": d.ranks,
            "first_rank": d.ranks[ctx.rollout_id],
            "deadline_seconds": d.deadline_seconds,
            "secret": d.secret,
            "transfer_floor_s": d.transfer.floor_s,
            "transfer_min_rate_mb_s": d.transfer.min_rate_mb_s,
            "bucket_deltas": nccl_delta.to_plain(d.bucket_deltas),
            **weights.manifest_to_plain(target.manifest),
        }
        try:
            await ctx.workers.call_workers(self.kind, "receive", spec)
        except BaseException as exc:  # a worker refused or failed before the rendezvous
            await self.refuse(target, f"{ctx.rollout_id} refused: {type(exc).__name__}: {exc}")
            await self._cancel(ctx, d.broadcast_id, f"{ctx.rollout_id} refused")
            raise
        # a little slack over the workers' own deadlines
        bound = collective_receive_s(d.deadline_seconds, d.transfer.for_bytes(target.manifest.total_bytes))
        limit = started + bound + 5.0
        try:
            while True:
                replies = await ctx.workers.call_workers(
                    self.kind, "poll", {"version": target.version, "broadcast_id": d.broadcast_id}
                )
                failed = [r for r in replies if r["status"] == "failed"]
                if failed:
                    first = failed[0]
                    error = _FAILURES.get(first["kind"], Unavailable)
                    raise error(f"receiving weight version {target.version} failed: {first['error']}")
                if all(r["status"] == "done" for r in replies):
                    break
                if time.perf_counter() > limit:
                    raise DeadlineExceeded(
                        f"weight version {target.version} not received within {limit - started:.0f}s "
                        f"(group {d.group_id})"
                    )
                await asyncio.sleep(_POLL_SECONDS)
        except BaseException as exc:  # failed, past the deadline, or the StageWeights call was cancelled
            await self._cancel(ctx, d.broadcast_id, f"{ctx.rollout_id} gave up: {type(exc).__name__}")
            raise
        staged = CollectiveStaged(
            target.version, target.manifest, (time.perf_counter() - started) * 1e3, d.broadcast_id
        )
        staged.received_bytes = int(replies[0].get("received", target.manifest.total_bytes))
        return staged

    async def _cancel(self, ctx: StageContext, broadcast_id: str, why: str) -> None:
        """Tell every worker to stop receiving `broadcast_id` (best effort, bounded; never raises)."""
        assert ctx.workers is not None
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(
                ctx.workers.call_workers(self.kind, "cancel", {"broadcast_id": broadcast_id, "why": why}),
                _NOTICE_S,
            )

    # ---- engine half
    def worker_op(self, op: str, spec: dict[str, Any], worker: WorkerContext) -> dict[str, Any]:
        receiver = worker.state.setdefault("nccl", NcclWorker())
        if op == "receive":
            return receiver.start(spec, worker)
        if op == "poll":
            return receiver.poll(int(spec["version"]), spec["broadcast_id"])
        if op == "cancel":
            return receiver.cancel(spec["broadcast_id"], spec.get("why", ""))
        raise InvalidArgument(f"unknown nccl worker operation {op!r}")

    def open_tensors(
        self, spec: dict[str, Any], tensors: list[weights.TensorEntry], worker: WorkerContext
    ) -> Any:
        receiver = worker.state.get("nccl")
        if receiver is None:
            raise FailedPrecondition(f"weight version {spec['version']} was not received by this worker")
        return receiver.open(spec, tensors)
