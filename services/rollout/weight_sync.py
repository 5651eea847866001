"""Weight staging of the rollout: fetch + verify a published version now, load it on commit.

Whatever the transport, a staged version ends up as a POSIX shared-memory segment laid out per its
manifest, so the engine (and vLLM's worker processes) load from one code path:

- shared_memory: attach the learner's segment by name (zero copy) and verify its bucket checksums.
- grpc_stream: stream `Learner.FetchWeights` (with a deadline) straight into a segment this process
  creates, verify the checksums, unlink it after the commit/abort.
- cuda_ipc / nccl / checkpoint: FailedPrecondition "not implemented yet".

One staged slot: staging a newer version replaces an older staged one.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import grpc

from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.clients import open_channel
from services.common.errors import (
    Aborted,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from services.common.logging import get_logger
from services.common.weights import Manifest, attach_segment, create_segment, verify_buckets

log = get_logger(__name__)


@dataclass(frozen=True)
class GrpcStreamSource:
    address: str


@dataclass(frozen=True)
class SharedMemorySource:
    segment_name: str
    size: int


@dataclass(frozen=True)
class UnsupportedSource:
    kind: str


Source = GrpcStreamSource | SharedMemorySource | UnsupportedSource


@dataclass(frozen=True)
class StageTarget:
    """A published weight version to stage (domain form of WeightVersion)."""

    version: int
    manifest: Manifest
    source: Source


@dataclass
class StagedWeights:
    """A fetched and verified version waiting for its commit."""

    version: int
    manifest: Manifest
    segment: shared_memory.SharedMemory
    owned: bool  # created by us (grpc_stream) → unlink on release
    fetch_ms: float

    @property
    def segment_name(self) -> str:
        return self.segment.name

    def release(self) -> None:
        """Detach (and unlink if ours). Safe to call twice."""
        try:
            self.segment.close()
        except BufferError:
            log.warning("staged segment still has views; leaving it mapped", segment=self.segment.name)
        if self.owned:
            self.owned = False
            # vLLM workers share our resource tracker and unregister on attach: re-register so
            # unlink()'s unregister is balanced.
            resource_tracker.register(self.segment._name, "shared_memory")
            try:
                self.segment.unlink()
            except FileNotFoundError:
                log.warning("staged segment already unlinked", segment=self.segment.name)


def _segment_name(rollout_id: str, version: int) -> str:
    safe = "".join(c if c.isalnum() else "_" for c in rollout_id)[:40]
    return f"grpo_rollout_{safe}_v{version}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


async def _verify(segment: shared_memory.SharedMemory, manifest: Manifest) -> None:
    """Bucket checksums (hashing runs in a thread: it releases the GIL)."""
    await asyncio.to_thread(verify_buckets, segment.buf, manifest.buckets)


async def stage_shared_memory(target: StageTarget, source: SharedMemorySource) -> StagedWeights:
    started = time.perf_counter()
    try:
        segment = attach_segment(source.segment_name)
    except FileNotFoundError as exc:
        raise FailedPrecondition(
            f"shared-memory segment {source.segment_name!r} does not exist on this host"
        ) from exc
    try:
        if segment.size < target.manifest.total_bytes:
            raise InvalidArgument(
                f"segment {source.segment_name!r} has {segment.size} bytes, "
                f"manifest needs {target.manifest.total_bytes}"
            )
        await _verify(segment, target.manifest)
    except BaseException:
        segment.close()
        raise
    return StagedWeights(
        target.version, target.manifest, segment, False, (time.perf_counter() - started) * 1e3
    )


async def stage_grpc_stream(
    target: StageTarget, source: GrpcStreamSource, rollout_id: str, timeout_s: float
) -> StagedWeights:
    """Stream every chunk of `target` from the learner into a fresh segment and verify it."""
    started = time.perf_counter()
    total = target.manifest.total_bytes
    segment = create_segment(_segment_name(rollout_id, target.version), total)
    received = 0
    try:
        buffer = segment.buf
        async with open_channel(source.address) as channel:
            stub = learner_pb2_grpc.LearnerServiceStub(channel)
            call = stub.FetchWeights(
                learner_pb2.FetchWeightsRequest(version=target.version), timeout=timeout_s
            )
            try:
                async for response in call:
                    chunk = response.chunk
                    size = len(chunk.data)
                    if chunk.version != target.version:
                        raise DataLoss(
                            f"FetchWeights sent version {chunk.version}, expected {target.version}"
                        )
                    if chunk.offset + size > total:
                        raise DataLoss(
                            f"FetchWeights chunk [{chunk.offset}, +{size}) lies outside {total} bytes"
                        )
                    buffer[chunk.offset : chunk.offset + size] = chunk.data
                    received += size
            except grpc.aio.AioRpcError as exc:
                raise _fetch_error(exc, source.address, target.version) from exc
        del buffer
        if received != total:
            raise DataLoss(f"FetchWeights v{target.version} delivered {received} of {total} bytes")
        await _verify(segment, target.manifest)
    except BaseException:
        segment.close()
        segment.unlink()
        raise
    return StagedWeights(
        target.version, target.manifest, segment, True, (time.perf_counter() - started) * 1e3
    )


def _fetch_error(exc: grpc.aio.AioRpcError, address: str, version: int) -> Exception:
    code, detail = exc.code(), exc.details()
    message = f"FetchWeights v{version} from {address} failed: {code.name}: {detail}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    if code in (
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
    ):
        return FailedPrecondition(message)
    if code == grpc.StatusCode.DATA_LOSS:
        return DataLoss(message)
    return Unavailable(message)


class WeightStager:
    """The one staged slot, guarded by a lock so stage / take / abort never interleave."""

    def __init__(self, rollout_id: str, fetch_timeout_s: float) -> None:
        self._rollout_id = rollout_id
        self._fetch_timeout_s = fetch_timeout_s
        self._staged: StagedWeights | None = None
        self._lock = asyncio.Lock()

    @property
    def staged_version(self) -> int:
        return self._staged.version if self._staged else -1

    async def stage(self, target: StageTarget, current_version: int) -> StagedWeights:
        if target.version <= current_version:
            raise Aborted(
                f"weight version {target.version} is not newer than the loaded version {current_version}"
            )
        if isinstance(target.source, UnsupportedSource):
            raise FailedPrecondition(f"{target.source.kind} weight transport is not implemented yet")
        async with self._lock:
            staged = self._staged
            if staged is not None and staged.version == target.version and staged.manifest == target.manifest:
                return staged  # a retried StageWeights: already fetched and verified
            if staged is not None and staged.version > target.version:
                raise Aborted(f"weight version {staged.version} is already staged; {target.version} is stale")
            if isinstance(target.source, SharedMemorySource):
                fresh = await stage_shared_memory(target, target.source)
            else:
                fresh = await stage_grpc_stream(
                    target, target.source, self._rollout_id, self._fetch_timeout_s
                )
            if self._staged is not None:
                self._staged.release()
            self._staged = fresh
            log.info(
                "weights staged",
                version=fresh.version,
                bytes=fresh.manifest.total_bytes,
                fetch_ms=round(fresh.fetch_ms, 1),
            )
            return fresh

    async def take(self, version: int) -> StagedWeights:
        """Hand the staged `version` to the committer (FailedPrecondition if it is not staged)."""
        async with self._lock:
            staged = self._staged
            if staged is None or staged.version != version:
                have = "nothing" if staged is None else f"v{staged.version}"
                raise FailedPrecondition(
                    f"weight version {version} is not staged ({have} is); call StageWeights first"
                )
            self._staged = None
            return staged

    async def put_back(self, staged: StagedWeights) -> None:
        """Return a taken version whose load failed, unless something newer was staged meanwhile."""
        async with self._lock:
            if self._staged is None:
                self._staged = staged
            else:
                staged.release()

    async def abort(self, version: int) -> bool:
        """Drop the staged `version` if it is the staged one. Returns whether something was dropped."""
        async with self._lock:
            if self._staged is None or self._staged.version != version:
                return False
            self._staged.release()
            self._staged = None
            return True

    def close(self) -> None:
        if self._staged is not None:
            self._staged.release()
            self._staged = None
