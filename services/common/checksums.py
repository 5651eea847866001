"""Bucket checksums of packed weights: fast enough never to dominate a transfer.

Two algorithms, chosen by where the bytes are (the manifest names the one used):

    xxh3_64   xxHash XXH3 64-bit over host bytes (a memoryview or a CPU tensor): ~10+ GB/s per core,
              against ~1 GB/s for SHA-256, which used to bound the shared-memory transport.
    wsum64    Σ w_i·(2i+1) mod 2^64 over the bucket's little-endian int64 words, computed with torch
              on whatever device holds the bytes: a GPU verifies what it received without copying it
              to the host. Each multiplier is odd, so any single flipped bit changes the sum; moving
              words to other positions almost always does. Integer sums wrap identically on every
              device and in any reduction order, so learner and rollout agree bit for bit.

Neither is cryptographic: they catch corruption and mix-ups, not an adversary (the transports'
peers are authenticated by the deployment, not by checksums).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Protocol

import torch
import xxhash

from grpo.common.v1 import types_pb2

_WSUM_CHUNK_WORDS = 1 << 21  # 16 MiB of int64 words per step: bounded scratch memory on any device


class ChecksumAlgorithm(StrEnum):
    """Member names equal values (what manifests and logs show)."""

    xxh3_64 = "xxh3_64"
    wsum64 = "wsum64"


DIGEST_HEX_CHARS = {ChecksumAlgorithm.xxh3_64: 16, ChecksumAlgorithm.wsum64: 16}
_TO_PROTO = {
    ChecksumAlgorithm.xxh3_64: types_pb2.CHECKSUM_ALGORITHM_XXH3_64,
    ChecksumAlgorithm.wsum64: types_pb2.CHECKSUM_ALGORITHM_WSUM64,
}
_FROM_PROTO = {value: key for key, value in _TO_PROTO.items()}


def to_proto(algorithm: ChecksumAlgorithm) -> types_pb2.ChecksumAlgorithm.ValueType:
    return _TO_PROTO[algorithm]


def from_proto(value: int) -> ChecksumAlgorithm | None:
    """The algorithm of a proto enum value; None when unset or unknown."""
    return _FROM_PROTO.get(value)


def digest(algorithm: ChecksumAlgorithm, data: memoryview | torch.Tensor) -> str:
    """Hex digest of `data` (bytes as a memoryview, or a uint8 tensor on any device)."""
    if algorithm == ChecksumAlgorithm.xxh3_64:
        if isinstance(data, torch.Tensor):
            data = memoryview(data.contiguous().cpu().numpy())
        return xxhash.xxh3_64_hexdigest(data)
    if not isinstance(data, torch.Tensor):
        data = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return f"{wsum64(data):016x}"


def streaming(algorithm: ChecksumAlgorithm) -> Callable[[], Hasher] | None:
    """A factory of incremental hashers whose hexdigest equals `digest` over the bytes fed to `update`
    in order, or None when the algorithm has none here (wsum64 is computed whole, on its device)."""
    return xxhash.xxh3_64 if algorithm == ChecksumAlgorithm.xxh3_64 else None


class Hasher(Protocol):
    def update(self, data: memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


def wsum64(data: torch.Tensor) -> int:
    """Σ w_i·(2i+1) mod 2^64 over the int64 words of a uint8 tensor whose length is a multiple of 8."""
    if data.numel() % 8:
        raise ValueError(f"wsum64 needs a multiple of 8 bytes, got {data.numel()}")
    words = data.contiguous().view(torch.int64)  # [n]
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _WSUM_CHUNK_WORDS):
        chunk = words[start : start + _WSUM_CHUNK_WORDS]  # [c]
        odd = torch.arange(start, start + chunk.numel(), device=data.device, dtype=torch.int64) * 2 + 1
        total += (chunk * odd).sum()  # int64 arithmetic wraps: mod 2^64
    return int(total.item()) & 0xFFFF_FFFF_FFFF_FFFF
