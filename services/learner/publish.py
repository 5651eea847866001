"""Prepared weight versions: packed snapshots the rollouts fetch, bounded in number.

`PreparedStore.prepare` packs a weight snapshot (services/common/weights.py layout and checksums)
either into process memory (served by FetchWeights over gRPC) or into a new POSIX shared-memory
segment named uniquely per run and version (rollouts on the same host attach it). A version stays
until `release`; at most `max_prepared` are held at once (ResourceExhausted beyond).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch

from services.common import weights
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted

GRPC_STREAM = "grpc_stream"
SHARED_MEMORY = "shared_memory"
KINDS = (GRPC_STREAM, SHARED_MEMORY)


@dataclass
class Prepared:
    """One packed version and where its bytes live."""

    version: int
    kind: str
    manifest: weights.Manifest
    buffer: bytearray | None = None
    segment: shared_memory.SharedMemory | None = None

    @property
    def segment_name(self) -> str:
        return self.segment.name.lstrip("/") if self.segment is not None else ""

    def view(self) -> memoryview:
        if self.buffer is not None:
            return memoryview(self.buffer)
        if self.segment is not None:
            return self.segment.buf
        raise NotFound(f"weight version {self.version} was released")

    def close(self) -> None:
        self.buffer = None
        if self.segment is not None:
            segment, self.segment = self.segment, None
            segment.close()
            segment.unlink()


class PreparedStore:
    """Thread-safe registry of prepared versions (prepare runs on the trainer thread)."""

    def __init__(self, run_id: str, max_prepared: int = 4, bucket_bytes: int = weights.DEFAULT_BUCKET_BYTES):
        self.run_id = run_id
        self.max_prepared = max_prepared
        self.bucket_bytes = bucket_bytes
        self._items: dict[int, Prepared] = {}
        self._lock = threading.Lock()

    def versions(self) -> list[int]:
        with self._lock:
            return sorted(self._items)

    def get(self, version: int) -> Prepared:
        with self._lock:
            item = self._items.get(version)
        if item is None:
            raise NotFound(f"weight version {version} is not prepared (prepared: {self.versions()})")
        return item

    def existing(self, version: int, kind: str) -> Prepared | None:
        """The already-prepared `version` if it has the same kind; FailedPrecondition if another kind."""
        with self._lock:
            item = self._items.get(version)
        if item is not None and item.kind != kind:
            raise FailedPrecondition(
                f"weight version {version} is already prepared as {item.kind}; "
                f"release it before preparing {kind}"
            )
        return item

    def check_capacity(self) -> None:
        with self._lock:
            if len(self._items) >= self.max_prepared:
                raise ResourceExhausted(
                    f"{len(self._items)} weight versions already prepared (max {self.max_prepared}): "
                    f"release some of {sorted(self._items)} first"
                )

    def prepare(self, version: int, kind: str, state: Mapping[str, torch.Tensor]) -> Prepared:
        """Pack `state` as `version` (call on the trainer thread; the snapshot is taken by the caller)."""
        if kind not in KINDS:
            raise InvalidArgument(f"unknown transport kind {kind!r}")
        existing = self.existing(version, kind)
        if existing is not None:
            return existing
        self.check_capacity()
        entries = weights.plan_layout(state)
        size = weights.packed_size(entries)
        if kind == GRPC_STREAM:
            buffer = bytearray(size)
            manifest = weights.build_manifest(state, memoryview(buffer), self.bucket_bytes)
            item = Prepared(version, kind, manifest, buffer=buffer)
        else:
            segment = weights.create_segment(f"grpo_{self.run_id}_v{version}", size)
            try:
                manifest = weights.build_manifest(state, segment.buf, self.bucket_bytes)
            except BaseException:
                segment.close()
                segment.unlink()
                raise
            item = Prepared(version, kind, manifest, segment=segment)
        with self._lock:
            self._items[version] = item
        return item

    def release(self, version: int) -> None:
        """Free a version (unlink its segment). NotFound if it is not prepared."""
        with self._lock:
            item = self._items.pop(version, None)
        if item is None:
            raise NotFound(f"weight version {version} is not prepared")
        item.close()

    def close(self) -> None:
        with self._lock:
            items, self._items = list(self._items.values()), {}
        for item in items:
            item.close()

    def chunks(
        self, version: int, buckets: list[int], chunk_bytes: int = weights.CHUNK_BYTES
    ) -> Iterator[tuple[int, int, bytes]]:
        """(bucket, offset, bytes) slices of ≤ chunk_bytes for the requested buckets (empty = all)."""
        item = self.get(version)
        by_index = {b.index: b for b in item.manifest.buckets}
        unknown = [b for b in buckets if b not in by_index]
        if unknown:
            raise InvalidArgument(
                f"weight version {version} has no bucket {unknown[0]} (has {len(by_index)})"
            )
        selected = [by_index[b] for b in buckets] if buckets else list(item.manifest.buckets)
        for bucket, offset, size in weights.chunk_ranges(selected, chunk_bytes):
            view = item.view()
            yield bucket, offset, bytes(view[offset : offset + size])
