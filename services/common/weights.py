"""Packing model weights into one flat byte buffer with a manifest and per-bucket checksums.

The learner packs its `state_dict()` (HF names, unsharded, in module order so tied heads and
layer-wise loaders see every tensor) into a contiguous buffer split into buckets; each bucket gets
a checksum (`checksums.py`: xxh3_64 over host bytes, wsum64 on a device). Rollouts receive the same
bytes by any transport (`services/transports/`), verify every bucket, and rebuild tensors as views
of the received bytes (`iter_tensors` on host memory, `tensor_views` on any device) - no pickle
anywhere. This layout is the one thing all transports share.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from grpo.common.v1 import types_pb2
from services.common import checksums
from services.common.checksums import ChecksumAlgorithm
from services.common.errors import DataLoss, InvalidArgument

DEFAULT_BUCKET_BYTES = 64 << 20
CHUNK_BYTES = 1 << 20  # bulk data travels in chunks of at most 1 MiB

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the wire form of a dtype."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError as exc:
        raise InvalidArgument(f"unsupported tensor dtype {name!r}") from exc


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the packed buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BucketEntry:
    """A checksummed byte range of the packed buffer."""

    index: int
    offset: int
    nbytes: int
    digest: str


@dataclass(frozen=True)
class LoraSpec:
    """A weight version that is a LoRA adapter (WeightVersion.adapter): its tensors are peft's adapter
    tensors over the receiver's own base model, the update B·A·alpha/rank."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    tensors: tuple[TensorEntry, ...]
    buckets: tuple[BucketEntry, ...]
    total_bytes: int
    algorithm: ChecksumAlgorithm = ChecksumAlgorithm.xxh3_64
    adapter: LoraSpec | None = None  # None: the whole state_dict


def plan_layout(state: Mapping[str, torch.Tensor]) -> list[TensorEntry]:
    """Offsets for each tensor, 64-byte aligned, in the mapping's order."""
    entries, offset = [], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(TensorEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes))
        offset += (nbytes + 63) // 64 * 64
    return entries


def packed_size(entries: list[TensorEntry]) -> int:
    if not entries:
        return 0
    last = entries[-1]
    return (last.offset + last.nbytes + 63) // 64 * 64


def _host_bytes(buffer: memoryview) -> torch.Tensor:
    """A uint8 tensor over `buffer`, zero-copy (torch.frombuffer rejects an empty buffer)."""
    return torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)


def pack_into(state: Mapping[str, torch.Tensor], entries: list[TensorEntry], buffer: memoryview) -> None:
    """Pack every tensor into the host `buffer` at its planned offset (padding zeroed)."""
    pack_range(state, entries, 0, _host_bytes(buffer)[: packed_size(entries)])


def pack_range(
    state: Mapping[str, torch.Tensor], entries: list[TensorEntry], start: int, out: torch.Tensor
) -> torch.Tensor:
    """Copy bytes [start, start + out.numel()) of the packed layout into the uint8 tensor `out`, on
    `out`'s device (device-to-device when the state lives there too); padding between tensors is zeroed.
    `entries` are in offset order (as `plan_layout` makes them)."""
    end = start + out.numel()
    done = start  # everything before this is written
    for entry in entries:
        lo, hi = max(entry.offset, start), min(entry.offset + entry.nbytes, end)
        if lo >= hi:
            continue
        if lo > done:
            out[done - start : lo - start].zero_()  # alignment padding
        source = state[entry.name].detach().contiguous().reshape(-1).view(torch.uint8)
        out[lo - start : hi - start].copy_(source[lo - entry.offset : hi - entry.offset], non_blocking=True)
        done = hi
    if done < end:
        out[done - start :].zero_()
    return out


def bucket_ranges(total: int, bucket_bytes: int) -> Iterator[tuple[int, int, int]]:
    """(index, offset, size) of the buckets that tile [0, total)."""
    for index, start in enumerate(range(0, total, bucket_bytes)):
        yield index, start, min(bucket_bytes, total - start)


def checksum_buckets(
    buffer: memoryview | torch.Tensor,
    total: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    algorithm: ChecksumAlgorithm = ChecksumAlgorithm.xxh3_64,
) -> list[BucketEntry]:
    """Split [0, total) into buckets and checksum each one (bytes, or a uint8 tensor on any device)."""
    return [
        BucketEntry(index, start, size, checksums.digest(algorithm, buffer[start : start + size]))
        for index, start, size in bucket_ranges(total, bucket_bytes)
    ]


def verify_buckets(buffer: memoryview | torch.Tensor, manifest: Manifest) -> None:
    """Raise DataLoss naming the first bucket whose bytes do not match their checksum."""
    for bucket in manifest.buckets:
        verify_bucket(buffer, manifest, bucket)


def verify_bucket(buffer: memoryview | torch.Tensor, manifest: Manifest, bucket: BucketEntry) -> None:
    """Raise DataLoss if `bucket`'s bytes in `buffer` do not match its checksum."""
    got = checksums.digest(manifest.algorithm, buffer[bucket.offset : bucket.offset + bucket.nbytes])
    check_digest(manifest, bucket, got)


def check_digest(manifest: Manifest, bucket: BucketEntry, got: str) -> None:
    """Raise DataLoss if `got`, the digest of `bucket`'s bytes as received, is not its checksum."""
    if got != bucket.digest:
        raise DataLoss(
            f"weight bucket {bucket.index} checksum mismatch ({manifest.algorithm}): "
            f"expected {bucket.digest}, got {got}"
        )


def iter_tensors(
    buffer: memoryview, tensors: tuple[TensorEntry, ...] | list[TensorEntry]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views over a host `buffer`, zero-copy; keep `buffer` alive while using them."""
    return tensor_views(_host_bytes(buffer), tensors)


def tensor_views(
    buffer: torch.Tensor, tensors: tuple[TensorEntry, ...] | list[TensorEntry]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) views into a uint8 tensor on any device (a receive or IPC buffer), zero-copy."""
    for entry in tensors:
        if entry.offset + entry.nbytes > buffer.numel():
            raise InvalidArgument(f"tensor {entry.name} lies outside the weight buffer")
        flat = buffer[entry.offset : entry.offset + entry.nbytes]
        yield entry.name, flat.view(dtype_from_name(entry.dtype)).reshape(entry.shape)


def chunk_ranges(
    buckets: list[BucketEntry] | tuple[BucketEntry, ...], chunk_bytes: int = CHUNK_BYTES
) -> Iterator[tuple[int, int, int]]:
    """(bucket index, offset, size) of each ≤ chunk_bytes slice, bucket by bucket."""
    for bucket in buckets:
        end = bucket.offset + bucket.nbytes
        for start in range(bucket.offset, end, chunk_bytes):
            yield bucket.index, start, min(chunk_bytes, end - start)


def manifest_to_plain(manifest: Manifest) -> dict[str, Any]:
    """The manifest as plain data (lists, ints, strings) for worker RPCs, which carry no dataclasses."""
    return {
        "algorithm": manifest.algorithm.value,
        "total_bytes": manifest.total_bytes,
        "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in manifest.tensors],
        "buckets": [[b.index, b.offset, b.nbytes, b.digest] for b in manifest.buckets],
        "adapter": None if (a := manifest.adapter) is None else [a.rank, a.alpha, list(a.target_modules)],
    }


def manifest_from_plain(plain: dict[str, Any]) -> Manifest:
    """The inverse of `manifest_to_plain` (other keys of `plain` are ignored)."""
    tensors = tuple(TensorEntry(n, d, tuple(s), o, b) for n, d, s, o, b in plain["tensors"])
    buckets = tuple(BucketEntry(i, o, n, d) for i, o, n, d in plain["buckets"])
    adapter = plain.get("adapter")
    spec = None if adapter is None else LoraSpec(int(adapter[0]), float(adapter[1]), tuple(adapter[2]))
    algorithm = ChecksumAlgorithm(plain["algorithm"])
    return Manifest(tensors, buckets, int(plain["total_bytes"]), algorithm, spec)


def adapter_to_proto(adapter: LoraSpec | None, message: types_pb2.WeightVersion) -> None:
    """Mark a WeightVersion as a LoRA adapter (nothing for None: the whole state_dict)."""
    if adapter is not None:
        message.adapter.rank, message.adapter.alpha = adapter.rank, adapter.alpha
        message.adapter.target_modules.extend(adapter.target_modules)


def _adapter_from_proto(
    message: types_pb2.WeightVersion, tensors: tuple[TensorEntry, ...]
) -> LoraSpec | None:
    """WeightVersion.adapter, checked: a rank, a positive alpha, modules, and only lora_A/lora_B tensors."""
    if not message.HasField("adapter"):
        return None
    a = message.adapter
    where = f"weight version {message.version}: adapter"
    if a.rank == 0 or not math.isfinite(a.alpha) or a.alpha <= 0 or not a.target_modules:
        raise InvalidArgument(f"{where} needs rank > 0, alpha > 0 and target_modules (got {a.rank}, "
                              f"{a.alpha}, {list(a.target_modules)})")  # fmt: skip
    for t in tensors:
        if not t.name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise InvalidArgument(
                f"{where}: tensor {t.name!r} is not a LoRA tensor (…lora_A.weight / …lora_B.weight)"
            )
    return LoraSpec(a.rank, a.alpha, tuple(a.target_modules))


def manifest_to_proto(manifest: Manifest, message: types_pb2.WeightVersion) -> None:
    """Fill the manifest fields (tensors, buckets, total_bytes, checksum_algorithm) of a WeightVersion."""
    message.total_bytes = manifest.total_bytes
    message.checksum_algorithm = checksums.to_proto(manifest.algorithm)
    for t in manifest.tensors:
        message.tensors.add(name=t.name, dtype=t.dtype, shape=list(t.shape), offset=t.offset, nbytes=t.nbytes)
    for b in manifest.buckets:
        message.buckets.add(index=b.index, offset=b.offset, nbytes=b.nbytes, digest=b.digest)


def manifest_from_proto(message: types_pb2.WeightVersion) -> Manifest:
    """Validate and convert the manifest of a WeightVersion message (InvalidArgument if inconsistent)."""
    tensors = tuple(TensorEntry(t.name, t.dtype, tuple(t.shape), t.offset, t.nbytes) for t in message.tensors)
    buckets = tuple(BucketEntry(b.index, b.offset, b.nbytes, b.digest) for b in message.buckets)
    if not tensors or not buckets:
        raise InvalidArgument(f"weight version {message.version} has an empty manifest")
    algorithm = checksums.from_proto(message.checksum_algorithm)
    if algorithm is None:
        raise InvalidArgument(
            f"weight version {message.version}: unknown checksum_algorithm {message.checksum_algorithm}"
        )
    _check_buckets(buckets, message.total_bytes, algorithm)
    _check_tensors(tensors, message.total_bytes)
    return Manifest(tensors, buckets, message.total_bytes, algorithm, _adapter_from_proto(message, tensors))


def _check_buckets(buckets: tuple[BucketEntry, ...], total: int, algorithm: ChecksumAlgorithm) -> None:
    """Buckets must tile [0, total) in order, numbered 0..n-1, each with a hex digest of `algorithm`."""
    expected_offset = 0
    width = checksums.DIGEST_HEX_CHARS[algorithm]
    for position, b in enumerate(buckets):
        if b.index != position:
            raise InvalidArgument(f"bucket at position {position} has index {b.index}")
        if b.offset != expected_offset or b.nbytes <= 0:
            raise InvalidArgument(
                f"bucket {b.index} covers [{b.offset}, {b.offset + b.nbytes}) but must start at "
                f"{expected_offset} and be non-empty (buckets tile the buffer in order)"
            )
        if len(b.digest) != width or any(c not in "0123456789abcdef" for c in b.digest):
            raise InvalidArgument(
                f"bucket {b.index} digest must be {width} lower-case hex digits ({algorithm}), "
                f"got {b.digest[:80]!r}"
            )
        expected_offset += b.nbytes
    if expected_offset != total:
        raise InvalidArgument(f"buckets cover {expected_offset} bytes but total_bytes is {total}")


def _check_tensors(tensors: tuple[TensorEntry, ...], total: int) -> None:
    """Names unique, dtype known, nbytes == numel × element size, bytes inside the buffer."""
    seen: set[str] = set()
    for t in tensors:
        if t.name in seen:
            raise InvalidArgument(f"tensor {t.name} appears twice in the manifest")
        seen.add(t.name)
        dtype = dtype_from_name(t.dtype)
        if any(dim < 0 for dim in t.shape):
            raise InvalidArgument(f"tensor {t.name} has a negative dimension: {list(t.shape)}")
        numel = 1
        for dim in t.shape:
            numel *= dim
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if t.nbytes != expected:
            raise InvalidArgument(
                f"tensor {t.name}: nbytes {t.nbytes} != {expected} for {t.dtype}{list(t.shape)}"
            )
        if t.offset + t.nbytes > total:
            raise InvalidArgument(f"tensor {t.name} lies outside the weight buffer")


def build_manifest(
    state: Mapping[str, torch.Tensor], buffer: memoryview, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Manifest:
    """Pack `state` into host `buffer` (sized with `packed_size(plan_layout(state))`) and checksum it."""
    entries = plan_layout(state)
    total = packed_size(entries)
    pack_into(state, entries, buffer)
    return Manifest(tuple(entries), tuple(checksum_buckets(buffer, total, bucket_bytes)), total)
