"""`nccl`: a broadcast from the learner (rank 0) to every rollout worker over a dedicated process group:
NCCL between CUDA devices, Gloo on CPU, one code path on every machine.

    learner   on its model thread: plans the packed layout, packs each bucket into ONE reusable staging
              buffer (bucket-sized, on the learner's device) to checksum it, answers PrepareWeights,
              then (`publish`, still on the model thread, so no optimizer step can interleave) packs
              and broadcasts bucket after bucket from the same buffer. The model's own tensors are read
              (no snapshot copy).
    rollout   asks every engine worker to receive (`worker_op("receive")` starts a thread there) and
              polls them until all verified their checksums, or one failed, or the deadline passed
    engine    each worker joins the group, receives every bucket into its own receive buffer (kept
              across versions), verifies it on its device, and loads from views of it on commit

The group is a stateless process group (`process_group.py`: no default group is touched, so it
coexists with vLLM's own and with any the learner uses). It is kept across versions and rebuilt under
a new `group_id` when its membership changes (a rollout joins, leaves or restarts) or it broke.

Deadlines: joining and every bucket's broadcast time out after `deadline_seconds`; a member that
never joins or dies mid-broadcast fails the version on every other member within that time, the group
is marked broken, and the next version (or the scheduler's retry) builds a new one without it.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from grpo.common.v1 import types_pb2
from services.common import checksums, weights
from services.common.checksums import ChecksumAlgorithm
from services.common.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    GrpoError,
    InvalidArgument,
    Unavailable,
)
from services.common.logging import get_logger
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
from services.transports.kinds import collective_receive_s
from services.transports.process_group import broadcast, close_group, member_names, open_group

log = get_logger(__name__)
_POLL_SECONDS = 0.02


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


def _algorithm(device: torch.device) -> ChecksumAlgorithm:
    """Checksums are computed where the bytes are: on the GPU for NCCL, on the host for Gloo."""
    return ChecksumAlgorithm.wsum64 if device.type == "cuda" else ChecksumAlgorithm.xxh3_64


# ---------------------------------------------------------------------------------------------- learner


@dataclass
class _Group:
    group_id: str
    members: tuple[Receiver, ...]
    ranks: dict[str, int]
    world_size: int
    backend: str
    handle: dist.ProcessGroup | None = None
    broken: bool = False


class _Sender:
    """The learner's side: its rendezvous store, current group and staging buffer (kept across versions)."""

    def __init__(self, ctx: PublishContext) -> None:
        timeout = datetime.timedelta(seconds=ctx.collective_timeout_s)
        self.address = ctx.advertise_address().rpartition(":")[0]  # the host rollouts reach us at
        # The rendezvous of every group this learner forms: listens on all interfaces at `collective_port`.
        self.store = dist.TCPStore(
            self.address, ctx.collective_port, is_master=True, wait_for_workers=False, timeout=timeout
        )
        self.timeout_s = ctx.collective_timeout_s
        self.group: _Group | None = None
        self.staging: torch.Tensor | None = None
        self.lock = threading.Lock()

    def group_for(self, receivers: tuple[Receiver, ...], backend: str) -> _Group:
        """The current group if its membership is `receivers` and it is sound, else a new one."""
        members = tuple(sorted(receivers, key=lambda r: r.rollout_id))
        group = self.group
        if group is not None and group.members == members and group.backend == backend and not group.broken:
            return group
        if group is not None:
            close_group(group.handle)
        ranks, next_rank = {}, 1
        for member in members:
            ranks[member.rollout_id] = next_rank
            next_rank += member.workers
        self.group = _Group(uuid.uuid4().hex[:12], members, ranks, next_rank, backend)
        log.info("weight-sync group formed", group_id=self.group.group_id, world_size=next_rank, ranks=ranks)
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
    ) -> None:
        super().__init__(version, manifest)
        self.sender, self.group, self.device = sender, group, device
        self._state: Mapping[str, torch.Tensor] | None = state
        self._entries = entries
        self.broadcast_id = uuid.uuid4().hex[:12]
        self.error = ""

    @property
    def descriptor(self) -> NcclDescriptor:
        group = self.group
        return NcclDescriptor(
            self.sender.address,
            self.sender.store.port,
            group.world_size,
            dict(group.ranks),
            group.group_id,
            self.sender.timeout_s,
            group.backend,
            self.broadcast_id,
        )

    def view(self) -> memoryview:
        raise FailedPrecondition(
            f"weight version {self.version} is broadcast over nccl; it has no byte buffer"
        )

    def publish(self) -> None:
        """Join (or reuse) the group and broadcast every bucket; on failure the group is marked broken."""
        state, self._state = self._state, None  # the model's own tensors: never held past this call
        if state is None:
            return
        group, timeout = self.group, self.sender.timeout_s
        started = time.perf_counter()
        try:
            with self.sender.lock:
                if group.handle is None:
                    group.handle = open_group(
                        group.backend, self.sender.address, self.sender.store.port, group.group_id, 0,
                        group.world_size, timeout, member_names(group.ranks, group.world_size),
                    )  # fmt: skip
                staging = self.sender.staging_for(max(b.nbytes for b in self.manifest.buckets), self.device)
                for bucket in self.manifest.buckets:
                    data = weights.pack_range(state, self._entries, bucket.offset, staging[: bucket.nbytes])
                    broadcast(group.handle, data, timeout)
        except Exception as exc:
            group.broken = True
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "weight broadcast failed", version=self.version, group_id=group.group_id, error=self.error
            )
            return
        log.info(
            "weights broadcast",
            version=self.version,
            group_id=group.group_id,
            bytes=self.manifest.total_bytes,
            ms=round((time.perf_counter() - started) * 1e3, 1),
        )

    def close(self) -> None:
        self._state = None


# ---------------------------------------------------------------------------------------------- workers


@dataclass
class _Receipt:
    version: int
    broadcast_id: str
    status: str = "receiving"  # receiving | done | failed
    kind: str = ""  # failure kind: deadline | data_loss | unavailable
    error: str = ""


class _Receiver:
    """One worker's side: its group membership, receive buffer and the receipt of the last version."""

    def __init__(self) -> None:
        self.group_id = ""
        self.handle: dist.ProcessGroup | None = None
        self.buffer: torch.Tensor | None = None
        self.receipt: _Receipt | None = None
        self.thread: threading.Thread | None = None
        self.loading = False
        self.lock = threading.Lock()

    def start(self, spec: dict[str, Any], worker: WorkerContext) -> dict[str, Any]:
        with self.lock:
            receipt = self.receipt
            if (
                receipt is not None
                and receipt.broadcast_id == spec["broadcast_id"]
                and receipt.status != "failed"
            ):
                return {"started": False}  # a retried StageWeights: the same receipt answers polls
            if self.thread is not None and self.thread.is_alive():
                raise FailedPrecondition(
                    f"still receiving weight version {receipt.version if receipt else '?'}"
                )
            if self.loading:
                raise FailedPrecondition("a weight load from the receive buffer is in progress")
            self.receipt = _Receipt(spec["version"], spec["broadcast_id"])
            self.thread = threading.Thread(
                target=self._receive, args=(spec, worker, self.receipt), name="grpo-nccl-receive", daemon=True
            )
            self.thread.start()
        return {"started": True}

    def poll(self, version: int, broadcast_id: str) -> dict[str, Any]:
        receipt = self.receipt
        if receipt is None or receipt.broadcast_id != broadcast_id:
            return {
                "status": "failed",
                "kind": "unavailable",
                "error": f"version {version} is not being received",
            }
        return {"status": receipt.status, "kind": receipt.kind, "error": receipt.error}

    def _receive(self, spec: dict[str, Any], worker: WorkerContext, receipt: _Receipt) -> None:
        timeout = float(spec["deadline_seconds"])
        rank = int(spec["first_rank"]) + worker.local_rank
        device = worker.device if spec["backend"] == "nccl" else torch.device("cpu")
        try:
            if self.handle is None or self.group_id != spec["group_id"]:
                close_group(self.handle)
                self.handle, self.group_id = None, ""
                world = int(spec["world_size"])
                self.handle = open_group(
                    spec["backend"], spec["master_address"], int(spec["master_port"]), spec["group_id"], rank,
                    world, timeout, member_names(spec["ranks"], world),
                )  # fmt: skip
                self.group_id = spec["group_id"]
            manifest = weights.manifest_from_plain(spec)
            total = manifest.total_bytes
            if self.buffer is None or self.buffer.numel() < total or self.buffer.device != device:
                self.buffer = torch.empty(total, dtype=torch.uint8, device=device)  # kept across versions
            for bucket in manifest.buckets:
                broadcast(self.handle, self.buffer[bucket.offset : bucket.offset + bucket.nbytes], timeout)
            try:
                weights.verify_buckets(self.buffer, manifest)
            except DataLoss as exc:
                receipt.kind, receipt.error, receipt.status = "data_loss", str(exc), "failed"
                return
            receipt.status = "done"
        except Exception as exc:
            close_group(self.handle)  # a failed collective leaves the group unusable
            self.handle, self.group_id = None, ""
            text = f"{type(exc).__name__}: {exc}"
            lowered = text.lower()
            timed_out = (
                isinstance(exc, TimeoutError | dist.DistStoreError)
                or "timeout" in lowered
                or "timed out" in lowered
            )
            receipt.kind = "deadline" if timed_out else "unavailable"
            me = member_names(spec["ranks"], int(spec["world_size"])).get(rank, "?")
            receipt.error = f"{me} (rank {rank}) of group {spec['group_id']}: {text}"[:2000]
            receipt.status = "failed"

    @contextmanager
    def open(
        self, spec: dict[str, Any], tensors: list[weights.TensorEntry]
    ) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        receipt = self.receipt
        if (
            receipt is None
            or receipt.broadcast_id != spec["broadcast_id"]
            or receipt.status != "done"
            or self.buffer is None
        ):
            raise FailedPrecondition(f"weight version {spec['version']} was not received by this worker")
        self.loading = True
        try:
            yield weights.tensor_views(self.buffer, tensors)
        finally:
            self.loading = False


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


_FAILURES: dict[str, type[GrpoError]] = {"deadline": DeadlineExceeded, "data_loss": DataLoss}


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
        buckets = []
        for index, start, size in weights.bucket_ranges(total, ctx.bucket_bytes):
            data = weights.pack_range(state, entries, start, staging[:size])
            buckets.append(weights.BucketEntry(index, start, size, checksums.digest(algorithm, data)))
        manifest = weights.Manifest(tuple(entries), tuple(buckets), total, algorithm)
        return NcclPrepared(version, manifest, sender, group, state, entries, device)

    def write_descriptor(self, prepared: Prepared, message: types_pb2.WeightVersion) -> None:
        assert isinstance(prepared, NcclPrepared)
        d = prepared.descriptor
        field = message.nccl
        field.master_address, field.master_port, field.world_size = (
            d.master_address,
            d.master_port,
            d.world_size,
        )
        field.ranks.update(d.ranks)
        field.group_id, field.deadline_seconds, field.backend = d.group_id, d.deadline_seconds, d.backend
        field.broadcast_id = d.broadcast_id

    # ---- rollout half
    def read_descriptor(self, message: types_pb2.WeightVersion) -> NcclDescriptor:
        field = message.nccl
        if not field.master_address or not field.master_port:
            raise InvalidArgument("weight_version.nccl needs master_address and master_port")
        if not field.group_id or not field.broadcast_id or field.backend not in ("nccl", "gloo"):
            raise InvalidArgument(
                "weight_version.nccl needs a group_id, a broadcast_id and backend nccl|gloo, "
                f"got {field.backend!r}"
            )
        if not field.deadline_seconds > 0:
            raise InvalidArgument("weight_version.nccl.deadline_seconds must be > 0")
        ranks = dict(field.ranks)
        if any(not 1 <= rank < field.world_size for rank in ranks.values()):
            raise InvalidArgument(f"weight_version.nccl ranks {ranks} must lie in [1, {field.world_size})")
        return NcclDescriptor(
            field.master_address, field.master_port, field.world_size, ranks, field.group_id,
            field.deadline_seconds, field.backend, field.broadcast_id,
        )  # fmt: skip

    async def stage(self, target: StageTarget, ctx: StageContext) -> Staged:
        d: NcclDescriptor = target.descriptor
        if ctx.workers is None:
            raise FailedPrecondition("the nccl transport needs an engine whose workers can receive")
        if ctx.rollout_id not in d.ranks:
            raise FailedPrecondition(
                f"rollout {ctx.rollout_id!r} is not a member of weight-sync group {d.group_id}"
            )
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
            **weights.manifest_to_plain(target.manifest),
        }
        await ctx.workers.call_workers(self.kind, "receive", spec)
        # a little slack over the workers' own timeouts
        limit = started + collective_receive_s(d.deadline_seconds, len(target.manifest.buckets)) + 5.0
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
        return CollectiveStaged(
            target.version, target.manifest, (time.perf_counter() - started) * 1e3, d.broadcast_id
        )

    # ---- engine half
    def worker_op(self, op: str, spec: dict[str, Any], worker: WorkerContext) -> dict[str, Any]:
        receiver = worker.state.setdefault("nccl", _Receiver())
        if op == "receive":
            return receiver.start(spec, worker)
        if op == "poll":
            return receiver.poll(int(spec["version"]), spec["broadcast_id"])
        raise InvalidArgument(f"unknown nccl worker operation {op!r}")

    def open_tensors(
        self, spec: dict[str, Any], tensors: list[weights.TensorEntry], worker: WorkerContext
    ) -> Any:
        receiver = worker.state.get("nccl")
        if receiver is None:
            raise FailedPrecondition(f"weight version {spec['version']} was not received by this worker")
        return receiver.open(spec, tensors)
