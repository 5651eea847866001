"""`shared_memory`: a POSIX shared-memory segment on the same host (also the load medium of grpc_stream).

    learner   packs the model's tensors into a new segment `grpo_<run>_v<version>` (unlinked on release)
    rollout   attaches the segment by name (zero copy) and verifies every bucket checksum
    engine    attaches it again where the weights load (the HF engine thread, each vLLM worker) and
              builds zero-copy tensor views with `torch.frombuffer`

Segments are named by the learner; the rollout only attaches names that look like ours and exist.
"""

from __future__ import annotations

import asyncio
import gc
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from grpo.common.v1 import types_pb2
from services.common import weights
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, quoted
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

log = get_logger(__name__)

# The only names a rollout attaches: what a learner publishes, `grpo_<learner instance>_v<version>`
# for the very version being staged. A caller can name no other segment (`../x`, another program's).
_SEGMENT_NAME = re.compile(r"grpo_([0-9A-Za-z]{1,32})_v(\d{1,19})")


def segment_name(run_id: str, version: int) -> str:
    return f"grpo_{run_id}_v{version}"


def check_segment_name(name: str, version: int) -> None:
    """InvalidArgument unless `name` is a learner's segment for `version`."""
    match = _SEGMENT_NAME.fullmatch(name) if len(name) <= 64 else None
    if match is None or int(match.group(2)) != version:
        raise InvalidArgument(
            f"weight_version.shared_memory.segment_name must be a learner's segment for version {version} "
            f"(grpo_<learner run id>_v{version}), got {quoted(name)}"
        )


_CREATED_HERE: set[str] = set()  # segments this process created (its tracker entry is the producer's)


def create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    """A new POSIX shared-memory segment owned (and later unlinked) by the caller."""
    segment = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    _CREATED_HERE.add(segment._name)
    return segment


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Attach to a producer's segment without letting this process's resource tracker unlink it."""
    segment = shared_memory.SharedMemory(name=name, create=False)
    # Python < 3.13 registers attached segments too and would unlink the producer's memory at exit.
    # When the producer is this same process, the one tracker entry is the producer's: keep it.
    if segment._name not in _CREATED_HERE:
        resource_tracker.unregister(segment._name, "shared_memory")
    return segment


def unlink_segment(segment: shared_memory.SharedMemory) -> None:
    """Unmap and unlink a segment this process created (balancing the resource tracker's entry).

    vLLM's workers share our resource tracker and unregister on attach, so the entry is registered
    again first; unlink() then unregisters it exactly once.
    """
    close_segment(segment)
    resource_tracker.register(segment._name, "shared_memory")
    try:
        segment.unlink()
    except FileNotFoundError:
        log.warning("segment already unlinked", segment=segment.name)


def close_segment(segment: shared_memory.SharedMemory) -> None:
    """Unmap; tensor views normally died with their iterator, else collect them first."""
    try:
        segment.close()
    except BufferError:
        gc.collect()
        try:
            segment.close()
        except BufferError:  # a view survived; the mapping goes away with the process
            log.warning("segment still has views; leaving it mapped", segment=segment.name)


async def verify(segment: shared_memory.SharedMemory, manifest: weights.Manifest) -> None:
    """Bucket checksums of a segment (hashing runs in a thread: it releases the GIL)."""
    await asyncio.to_thread(weights.verify_buckets, segment.buf, manifest)


@dataclass(frozen=True)
class SharedMemoryDescriptor:
    segment_name: str
    size: int


class SharedMemoryPrepared(Prepared):
    kind = TransportKind.shared_memory

    def __init__(self, version: int, manifest: weights.Manifest, segment: shared_memory.SharedMemory):
        super().__init__(version, manifest)
        self.segment: shared_memory.SharedMemory | None = segment

    @property
    def segment_name(self) -> str:
        return self.segment.name.lstrip("/") if self.segment is not None else ""

    def view(self) -> memoryview:
        if self.segment is None:
            raise NotFound(f"weight version {self.version} was released")
        return self.segment.buf

    def close(self) -> None:
        if self.segment is not None:
            segment, self.segment = self.segment, None
            segment.close()
            segment.unlink()


class SegmentStaged(Staged):
    """Staged bytes in a segment: the learner's (attached) or our own (grpc_stream; unlinked on release)."""

    def __init__(
        self,
        version: int,
        manifest: weights.Manifest,
        segment: shared_memory.SharedMemory,
        owned: bool,
        fetch_ms: float,
    ) -> None:
        super().__init__(version, manifest, fetch_ms)
        self.segment = segment
        self.owned = owned
        self._released = False

    @property
    def plan(self) -> LoadPlan:
        return LoadPlan(TransportKind.shared_memory, {"segment_name": self.segment.name})

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self.owned:
            unlink_segment(self.segment)
        else:
            close_segment(self.segment)


class SharedMemoryTransport(WeightTransport):
    kind = TransportKind.shared_memory
    # `prepare` copies every tensor into the segment before it returns (on the model thread): a CPU
    # snapshot first would copy the model twice (~40 ms of a ~140 ms prepare for 127 MB, measured).
    live_state = True

    # ---- learner half
    def prepare(
        self,
        version: int,
        state: Mapping[str, torch.Tensor],
        ctx: PublishContext,
        receivers: tuple[Receiver, ...] = (),
    ) -> Prepared:
        entries = weights.plan_layout(state)
        segment = create_segment(segment_name(ctx.run_id, version), weights.packed_size(entries))
        try:
            manifest = weights.build_manifest(state, segment.buf, ctx.bucket_bytes)
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        return SharedMemoryPrepared(version, manifest, segment)

    def write_descriptor(self, prepared: Prepared, message: types_pb2.WeightVersion) -> None:
        assert isinstance(prepared, SharedMemoryPrepared)
        message.shared_memory.segment_name = prepared.segment_name
        message.shared_memory.size = prepared.manifest.total_bytes

    # ---- rollout half
    def read_descriptor(self, message: types_pb2.WeightVersion) -> SharedMemoryDescriptor:
        name = message.shared_memory.segment_name
        check_segment_name(name, message.version)
        return SharedMemoryDescriptor(name, message.shared_memory.size)

    async def stage(self, target: StageTarget, ctx: StageContext) -> Staged:
        started = time.perf_counter()
        name = target.descriptor.segment_name
        try:
            segment = attach_segment(name)
        except FileNotFoundError as exc:
            raise FailedPrecondition(f"shared-memory segment {name!r} does not exist on this host") from exc
        try:
            if segment.size < target.manifest.total_bytes:
                raise InvalidArgument(
                    f"segment {name!r} has {segment.size} bytes, manifest needs {target.manifest.total_bytes}"
                )
            await verify(segment, target.manifest)
        except BaseException:
            segment.close()
            raise
        return SegmentStaged(
            target.version, target.manifest, segment, False, (time.perf_counter() - started) * 1e3
        )

    # ---- engine half
    @contextmanager
    def open_tensors(
        self, spec: dict[str, Any], tensors: list[weights.TensorEntry], worker: WorkerContext
    ) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        segment = attach_segment(spec["segment_name"])
        try:
            yield weights.iter_tensors(segment.buf, tensors)
        finally:
            close_segment(segment)
