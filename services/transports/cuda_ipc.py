"""`cuda_ipc`: rollouts on the learner's physical GPU attach to the learner's GPU memory.

    learner   staging buffers ("slots") on its GPU, each allocated and exported ONCE (a CUDA IPC
              handle each, from `torch.multiprocessing.reductions.reduce_tensor`). A slot is rewritten
              only when every rollout that may read it is confirmed off it by the scheduler (it serves
              another version or copied its weights out: `RolloutEngine.own_weights`), so a rollout
              that is alive but unreachable keeps reading intact weights: the fence,
              `cuda_ipc_fence.py`. With every rollout synced each step that is a double buffer (v in
              the slot of v - 2); an unreachable reader costs a third slot, and past that PrepareWeights
              is refused (FAILED_PRECONDITION) until it comes back. Checksums are computed on the GPU
              (wsum64).
    rollout   every engine worker (each its own process) checks the export against its own device
              (by GPU UUID) and the manifest against the export (dtypes, shapes, byte ranges) before
              touching anything, opens each handle ONCE per process (cached), and verifies the
              checksums on the GPU
    engine    views of the learner's buffer: the transformers engine adopts them as its parameters
              (`zero_copy` in the plan: no second copy of the weights); vLLM copies them through its
              loader (one device-to-device copy)

Receivers' processes must share the GPU, the IPC namespace and a PID namespace with the learner
(docker: `ipc: host`, `pid: host`, the same device ids). Handles travel as explicit proto fields:
never pickle. Nothing here runs without CUDA; `check_export` (pure) is tested on CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from grpo.common.v1 import types_pb2
from services.common import weights
from services.common.checksums import ChecksumAlgorithm
from services.common.errors import FailedPrecondition, InvalidArgument
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
from services.transports.cuda_ipc_fence import DEFAULT_MAX_SLOTS, HOLDERS_KEY, Holder, SlotFence

log = get_logger(__name__)


@dataclass(frozen=True)
class IpcExport:
    """One exported staging buffer: what `rebuild_cuda_tensor` needs, as plain values."""

    slot: int
    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    nbytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    def to_spec(self) -> dict[str, Any]:
        """Plain data for worker RPCs (bytes as hex: vLLM's msgpack carries them, JSON would not)."""
        return {k: v.hex() if isinstance(v, bytes) else v for k, v in asdict(self).items()}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> IpcExport:
        return cls(
            **{
                f.name: bytes.fromhex(spec[f.name]) if f.type == "bytes" else spec[f.name]
                for f in fields(cls)
            }
        )


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID: the one identity two processes with different CUDA_VISIBLE_DEVICES share."""
    return str(torch.cuda.get_device_properties(device).uuid)


def check_export(manifest: weights.Manifest, export: IpcExport, local_uuid: str | None) -> None:
    """Refuse, before touching any memory, an export this worker cannot or must not read."""
    if local_uuid is None:
        raise FailedPrecondition("cuda_ipc needs this rollout worker on a CUDA device")
    if export.device_uuid != local_uuid:
        raise FailedPrecondition(
            f"the weights are on GPU {export.device_uuid}, this worker is on {local_uuid}: cuda_ipc only "
            "works on the same physical GPU (use nccl across GPUs)"
        )
    if not export.handle:
        raise InvalidArgument("weight_version.cuda_ipc has no memory handle")
    # storage_offset_bytes places the storage inside the CUDA allocation the handle opens (the caching
    # allocator carves small buffers out of larger segments: 8,704 bytes in, on an H200), so it is no
    # bound on the buffer; the buffer must fit its storage
    if export.nbytes > export.storage_size_bytes:
        raise InvalidArgument(
            f"exported buffer of {export.nbytes} bytes is larger than its storage of "
            f"{export.storage_size_bytes} bytes"
        )
    if manifest.total_bytes > export.nbytes:
        raise InvalidArgument(f"manifest needs {manifest.total_bytes} bytes; the export has {export.nbytes}")
    if manifest.algorithm != ChecksumAlgorithm.wsum64:
        raise InvalidArgument(
            f"cuda_ipc checksums are wsum64 (computed on the GPU), got {manifest.algorithm}"
        )
    for entry in manifest.tensors:
        weights.dtype_from_name(entry.dtype)  # InvalidArgument for an unknown dtype
        if entry.offset + entry.nbytes > export.nbytes:
            raise InvalidArgument(f"tensor {entry.name} lies outside the exported buffer")


# ---------------------------------------------------------------------------------------------- learner


class _Exporter:
    """The learner's staging buffers and their exports (each made once, kept for the process's life),
    and the fence that says which one a version may be packed into (thread-safe: prepare runs on the
    model thread, release on another)."""

    def __init__(self, max_slots: int = DEFAULT_MAX_SLOTS) -> None:
        self.fence = SlotFence(max_slots)
        self.lock = threading.Lock()
        self.buffers: list[torch.Tensor | None] = [None] * max_slots
        self.exports: list[IpcExport | None] = [None] * max_slots

    def claim(self, version: int, holders: list[Holder] | None) -> int:
        """A slot for `version` that no rollout may still read (`SlotFence.choose`)."""
        with self.lock:
            return self.fence.choose(version, holders)

    def abandon(self, slot: int) -> None:
        with self.lock:
            self.fence.abandon(slot)

    def describe(self, slot: int, receivers: tuple[Receiver, ...]) -> None:
        with self.lock:
            self.fence.describe(slot, ((r.rollout_id, r.instance_id) for r in receivers))

    def released(self, slot: int) -> None:
        with self.lock:
            self.fence.released(slot)

    def buffer(self, slot: int, size: int, device: torch.device) -> tuple[torch.Tensor, IpcExport]:
        current = self.buffers[slot]
        if current is None or current.numel() < size or current.device != device:
            from torch.multiprocessing.reductions import reduce_tensor

            current = torch.empty(size, dtype=torch.uint8, device=device)
            _, args = reduce_tensor(current)
            (
                _,
                _,
                _,
                _,
                _,
                _,
                _,
                handle,
                storage_size,
                storage_offset,
                _,
                ref_handle,
                ref_offset,
                event,
                sync,
            ) = args
            self.buffers[slot] = current
            self.exports[slot] = IpcExport(
                slot, device_uuid(device), bytes(handle), int(storage_size), int(storage_offset), size,
                bytes(ref_handle or b""), int(ref_offset or 0), bytes(event or b""), bool(sync),
            )  # fmt: skip
            log.info("cuda ipc staging buffer exported", slot=slot, bytes=size, device=str(device))
        export = self.exports[slot]
        assert export is not None
        return current, export


class CudaIpcPrepared(Prepared):
    kind = TransportKind.cuda_ipc

    def __init__(
        self, version: int, manifest: weights.Manifest, export: IpcExport, exporter: _Exporter
    ) -> None:
        super().__init__(version, manifest)
        self.export = export
        self._exporter = exporter

    def view(self) -> memoryview:
        raise FailedPrecondition(f"weight version {self.version} lives in GPU memory (cuda_ipc)")

    def described_to(self, receivers: tuple[Receiver, ...]) -> None:
        """A repeated PrepareWeights of this version names these receivers: they may read its slot."""
        self._exporter.describe(self.export.slot, receivers)

    def close(self) -> None:
        self._exporter.released(self.export.slot)  # no stage of it is under way any more
        torch.cuda.ipc_collect()  # free what consumers released (the staging buffers themselves stay)


# ---------------------------------------------------------------------------------------------- workers


class _Attachments:
    """One worker's opened handles (once per process and buffer) and the version each holds."""

    def __init__(self) -> None:
        self.buffers: dict[bytes, torch.Tensor] = {}
        self.verified: dict[int, tuple[bytes, weights.Manifest]] = {}  # version -> (handle, manifest)

    def attach(self, spec: dict[str, Any], worker: WorkerContext) -> dict[str, Any]:
        manifest = weights.manifest_from_plain(spec)
        export = IpcExport.from_spec(spec["export"])
        local = device_uuid(worker.device) if worker.device.type == "cuda" else None
        check_export(manifest, export, local)
        buffer = self.buffers.get(export.handle)
        if buffer is None:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            buffer = rebuild_cuda_tensor(
                torch.Tensor, (export.nbytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8,
                worker.device.index or 0, export.handle, export.storage_size_bytes,
                export.storage_offset_bytes,
                False, export.ref_counter_handle, export.ref_counter_offset, export.event_handle,
                export.event_sync_required,
            )  # fmt: skip
            self.buffers[export.handle] = buffer
        weights.verify_buckets(buffer, manifest)
        self.verified = {v: entry for v, entry in self.verified.items() if v >= int(spec["version"]) - 1}
        self.verified[int(spec["version"])] = (export.handle, manifest)
        return {"attached": True}

    @contextmanager
    def open(
        self, version: int, tensors: list[weights.TensorEntry]
    ) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        entry = self.verified.get(version)
        if entry is None:
            raise FailedPrecondition(f"weight version {version} was not attached by this worker")
        yield weights.tensor_views(self.buffers[entry[0]], tensors)


# ---------------------------------------------------------------------------------------------- transport


class AttachedStaged(Staged):
    """A version every worker of this rollout attached to and verified, in the learner's buffer."""

    @property
    def plan(self) -> LoadPlan:
        return LoadPlan(TransportKind.cuda_ipc, {"version": self.version}, zero_copy=True)

    def release(self) -> None:
        """Nothing to free: handles stay open for the process's life (one per learner buffer)."""


class CudaIpcTransport(WeightTransport):
    kind = TransportKind.cuda_ipc
    live_state = True

    # ---- learner half
    def prepare(
        self,
        version: int,
        state: Mapping[str, torch.Tensor],
        ctx: PublishContext,
        receivers: tuple[Receiver, ...] = (),
    ) -> Prepared:
        device = next(iter(state.values())).device
        if device.type != "cuda":
            raise FailedPrecondition(
                "cuda_ipc needs the learner on a CUDA device (use nccl or shared_memory)"
            )
        exporter = ctx.state.setdefault("cuda_ipc", _Exporter())
        entries = weights.plan_layout(state)
        total = weights.packed_size(entries)
        slot = exporter.claim(version, ctx.state.get(HOLDERS_KEY))
        try:
            buffer, export = exporter.buffer(slot, total, device)
            weights.pack_range(state, entries, 0, buffer[:total])  # device-to-device copies
            buckets = weights.checksum_buckets(buffer, total, ctx.bucket_bytes, ChecksumAlgorithm.wsum64)
            torch.cuda.synchronize(device)  # consumers in other processes read after this returns
        except BaseException:
            exporter.abandon(slot)  # never described: free for the next version
            raise
        exporter.describe(slot, receivers)  # they may read it from now on
        manifest = weights.Manifest(tuple(entries), tuple(buckets), total, ChecksumAlgorithm.wsum64)
        return CudaIpcPrepared(version, manifest, export, exporter)

    def write_descriptor(self, prepared: Prepared, message: types_pb2.WeightVersion) -> None:
        assert isinstance(prepared, CudaIpcPrepared)
        e = prepared.export
        message.cuda_ipc.buckets.add(
            device_uuid=e.device_uuid, handle=e.handle, storage_offset=e.storage_offset_bytes,
            nbytes=e.nbytes,
            ref_counter_handle=e.ref_counter_handle, ref_counter_offset=e.ref_counter_offset,
            event_handle=e.event_handle, storage_size_bytes=e.storage_size_bytes,
            event_sync_required=e.event_sync_required, slot=e.slot,
        )  # fmt: skip

    # ---- rollout half
    def read_descriptor(self, message: types_pb2.WeightVersion) -> IpcExport:
        if len(message.cuda_ipc.buckets) != 1:
            raise InvalidArgument(
                "weight_version.cuda_ipc must describe exactly one exported buffer, "
                f"got {len(message.cuda_ipc.buckets)}"
            )
        b = message.cuda_ipc.buckets[0]
        if not b.device_uuid or not b.handle or not b.nbytes:
            raise InvalidArgument("weight_version.cuda_ipc needs device_uuid, handle and nbytes")
        return IpcExport(
            b.slot, b.device_uuid, b.handle, b.storage_size_bytes, b.storage_offset, b.nbytes,
            b.ref_counter_handle, b.ref_counter_offset, b.event_handle, b.event_sync_required,
        )  # fmt: skip

    async def stage(self, target: StageTarget, ctx: StageContext) -> Staged:
        if ctx.workers is None:
            raise FailedPrecondition("the cuda_ipc transport needs an engine whose workers can attach")
        started = time.perf_counter()
        spec = {
            "version": target.version,
            "export": target.descriptor.to_spec(),
            **weights.manifest_to_plain(target.manifest),
        }
        await ctx.workers.call_workers(self.kind, "attach", spec)
        return AttachedStaged(target.version, target.manifest, (time.perf_counter() - started) * 1e3)

    # ---- engine half
    def worker_op(self, op: str, spec: dict[str, Any], worker: WorkerContext) -> dict[str, Any]:
        if op != "attach":
            raise InvalidArgument(f"unknown cuda_ipc worker operation {op!r}")
        return worker.state.setdefault("cuda_ipc", _Attachments()).attach(spec, worker)

    def open_tensors(
        self, spec: dict[str, Any], tensors: list[weights.TensorEntry], worker: WorkerContext
    ) -> Any:
        attachments = worker.state.get("cuda_ipc")
        if attachments is None:
            raise FailedPrecondition(f"weight version {spec['version']} was not attached by this worker")
        return attachments.open(int(spec["version"]), tensors)
