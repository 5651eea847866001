"""Sparse deltas of a packed weight bucket: only the words whose bytes changed since a base version.

A bucket is a byte range of the packed layout (`weights.py`). Against the same bucket of a base
version, its delta lists the changed `word`-byte words (the rollout dtype's element size: 2 for
bf16/fp16) in the smaller of two encodings, or the whole bucket when neither is smaller:

    INDICES  uint32 little-endian word indices [n], then the n new words        n · (4 + word) bytes
    BITMAP   one bit per word, little-endian bit order [ceil(words / 8)],       words / 8 + n · word
             then the new words of the set bits, in order
    FULL     the bucket's new bytes                                              words · word

`apply` rewrites a copy of the base in place. What it produces is only trusted once it matches the
bucket's checksum in the new version's manifest (the caller checks, as for any received bucket), so
a delta applied to the wrong base is refused rather than loaded.

`encode_tensor` / `apply_tensor` are the same encodings (byte for byte) on uint8 torch tensors of
DELTA_WORD words, on any device: the nccl transport diffs and rebuilds buckets where they are (a GPU
for NCCL, the host for Gloo) instead of copying them out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from services.common.checksums import ChecksumAlgorithm, digest
from services.common.errors import DataLoss, InvalidArgument
from services.common.weights import Manifest, dtype_from_name

_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INDEX = np.dtype("<u4")


# 16-bit words: the rollout dtypes in which one small optimizer step leaves most values unchanged
DELTA_WORD = 2


class Encoding(enum.IntEnum):
    """The values are the wire's BucketEncoding (types.proto): FULL is its UNSPECIFIED, whole bytes."""

    FULL = 0
    INDICES = 1
    BITMAP = 2


def delta_word(manifest: Manifest) -> int | None:
    """The word a version's buckets are diffed in: DELTA_WORD when every tensor is bf16 or fp16 (and
    so every bucket a whole number of words), else None: fp32 changes almost every word each step."""
    if not manifest.tensors or manifest.total_bytes % DELTA_WORD:
        return None
    sizes = {dtype_from_name(t.dtype).itemsize for t in manifest.tensors}
    return DELTA_WORD if sizes == {DELTA_WORD} else None


def base_digest(manifest: Manifest) -> str:
    """Names a version's bytes: xxh3_64 of its bucket digests joined by ","."""
    return digest(
        ChecksumAlgorithm.xxh3_64, memoryview(",".join(b.digest for b in manifest.buckets).encode())
    )


@dataclass(frozen=True)
class Delta:
    """One bucket's change: how it is encoded, and the payload (see the module docstring)."""

    encoding: Encoding
    payload: bytes | memoryview
    changed: int  # words that differ from the base (all of them for FULL)


def _words(buffer: bytes | bytearray | memoryview, word: int) -> np.ndarray:
    if word not in _WORDS:
        raise InvalidArgument(f"delta word size must be one of {sorted(_WORDS)}, got {word}")
    if len(buffer) % word:
        raise InvalidArgument(f"a bucket of {len(buffer)} bytes is not a whole number of {word}-byte words")
    return np.frombuffer(buffer, dtype=np.dtype(_WORDS[word]).newbyteorder("<"))


def sizes(words: int, changed: int, word: int) -> dict[Encoding, int]:
    """Payload bytes of each encoding for a bucket of `words` words of which `changed` differ."""
    return {
        Encoding.FULL: words * word,
        Encoding.INDICES: changed * (_INDEX.itemsize + word),
        Encoding.BITMAP: (words + 7) // 8 + changed * word,
    }


def _best(cost: dict[Encoding, int]) -> Encoding:
    return min(cost, key=lambda e: (cost[e], e))  # ties: FULL first (nothing to decode)


def encode(base: bytes | bytearray | memoryview, new: bytes | bytearray | memoryview, word: int) -> Delta:
    """The smallest encoding of `new` against `base` (same length), comparing `word`-byte words."""
    if len(base) != len(new):
        raise InvalidArgument(f"a delta needs buckets of one size: base {len(base)}, new {len(new)} bytes")
    old_words, new_words = _words(base, word), _words(new, word)
    mask = old_words != new_words  # [words]
    indices = np.flatnonzero(mask)  # [changed], ascending
    changed = int(indices.size)
    cost = sizes(len(new_words), changed, word)
    best = _best(cost)
    if best is Encoding.FULL:
        return Delta(Encoding.FULL, memoryview(new).cast("B"), len(new_words))
    values = new_words[indices].tobytes()  # [changed] words, in index order
    if best is Encoding.INDICES:
        return Delta(Encoding.INDICES, indices.astype(_INDEX).tobytes() + values, changed)
    bitmap = np.packbits(mask, bitorder="little").tobytes()  # [ceil(words / 8)]
    return Delta(Encoding.BITMAP, bitmap + values, changed)


def apply(target: bytearray | memoryview, delta: Delta, word: int) -> int:
    """Turn `target` (a writable copy of the base bucket) into the new bucket; returns words written.
    A payload whose size does not fit its encoding and the bucket is DataLoss (nothing is written)."""
    view = memoryview(target).cast("B")
    out = _words(view, word)  # writable: a view of `target`
    words = out
    payload = memoryview(delta.payload).cast("B")
    if delta.encoding is Encoding.FULL:
        if len(payload) != len(view):
            raise DataLoss(f"a full bucket delta carries {len(payload)} bytes, the bucket has {len(view)}")
        view[:] = payload
        return len(words)
    if delta.encoding is Encoding.INDICES:
        per = _INDEX.itemsize + word
        if len(payload) % per:
            raise DataLoss(f"an index delta of {len(payload)} bytes is not whole (index, word) pairs")
        n = len(payload) // per
        indices = np.frombuffer(payload[: n * _INDEX.itemsize], dtype=_INDEX)  # [n]
        values = np.frombuffer(payload[n * _INDEX.itemsize :], dtype=words.dtype)  # [n]
        if n and int(indices.max()) >= len(words):
            raise DataLoss(f"an index delta names word {int(indices.max())} of a {len(words)}-word bucket")
        out[indices] = values
        return n
    if delta.encoding is Encoding.BITMAP:
        bitmap_bytes = (len(words) + 7) // 8
        if len(payload) < bitmap_bytes:
            raise DataLoss(f"a bitmap delta of {len(payload)} bytes is shorter than its {bitmap_bytes} B map")
        mask = np.unpackbits(
            np.frombuffer(payload[:bitmap_bytes], dtype=np.uint8), count=len(words), bitorder="little"
        ).astype(bool)  # [words]
        values = payload[bitmap_bytes:]
        n = int(np.count_nonzero(mask))
        if len(values) != n * word:
            raise DataLoss(f"a bitmap delta marks {n} words but carries {len(values)} bytes of values")
        out[mask] = np.frombuffer(values, dtype=words.dtype)
        return n
    raise InvalidArgument(f"unknown delta encoding {delta.encoding!r}")


# ---------------------------------------------------------------------------------------------- torch

_BIT_WEIGHTS = (1, 2, 4, 8, 16, 32, 64, 128)  # little-endian bit order within a bitmap byte


def encode_tensor(base: torch.Tensor, new: torch.Tensor) -> tuple[Encoding, torch.Tensor | None, int]:
    """`encode` of two uint8 buckets of one length (DELTA_WORD words) on their own device: the
    encoding, its payload (uint8, on that device; None for FULL: the bucket itself) and the words
    that changed. The payload bytes equal `encode`'s for the same buckets (little-endian devices)."""
    if base.numel() != new.numel() or new.numel() % DELTA_WORD:
        raise InvalidArgument(f"a delta needs buckets of one size in words: {base.numel()}, {new.numel()} B")
    old_words, new_words = base.view(torch.int16), new.view(torch.int16)  # [words]
    mask = old_words != new_words  # [words]
    changed = int(mask.sum())
    best = _best(sizes(new_words.numel(), changed, DELTA_WORD))
    if best is Encoding.FULL:
        return best, None, new_words.numel()
    values = new_words[mask].view(torch.uint8)  # [changed · 2], in index order
    if best is Encoding.INDICES:
        indices = mask.nonzero().flatten().to(torch.int32).view(torch.uint8)  # [changed · 4]
        return best, torch.cat([indices, values]), changed
    padded = torch.nn.functional.pad(mask, (0, -mask.numel() % 8)).view(-1, 8)  # [ceil(words / 8), 8]
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    bitmap = (padded.to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)  # [ceil(words / 8)]
    return best, torch.cat([bitmap, values]), changed


def apply_tensor(target: torch.Tensor, encoding: Encoding, payload: torch.Tensor) -> int:
    """`apply` on a uint8 bucket tensor (the base, rewritten in place) from a uint8 payload on the
    same device; returns the words written. A payload that does not fit is DataLoss."""
    words = target.view(torch.int16)  # [words], a view of `target`
    if encoding is Encoding.FULL:
        if payload.numel() != target.numel():
            raise DataLoss(f"a full bucket carries {payload.numel()} bytes, the bucket has {target.numel()}")
        target.copy_(payload)
        return words.numel()
    if encoding is Encoding.INDICES:
        per = _INDEX.itemsize + DELTA_WORD
        if payload.numel() % per:
            raise DataLoss(f"an index delta of {payload.numel()} bytes is not whole (index, word) pairs")
        n = payload.numel() // per
        indices = payload[: n * _INDEX.itemsize].view(torch.int32).long()  # [n]
        if n and int(indices.max()) >= words.numel():
            raise DataLoss(f"an index delta names word {int(indices.max())} of a {words.numel()}-word bucket")
        words[indices] = payload[n * _INDEX.itemsize :].view(torch.int16)
        return n
    if encoding is Encoding.BITMAP:
        map_bytes = (words.numel() + 7) // 8
        if payload.numel() < map_bytes:
            raise DataLoss(f"a bitmap delta of {payload.numel()} bytes is shorter than its {map_bytes} B map")
        shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
        mask = ((payload[:map_bytes, None] >> shifts) & 1).flatten()[: words.numel()].bool()  # [words]
        values = payload[map_bytes:].clone()  # an odd map leaves the values unaligned for int16
        n = int(mask.sum())
        if values.numel() != n * DELTA_WORD:
            raise DataLoss(f"a bitmap delta marks {n} words but carries {values.numel()} bytes of values")
        words[mask] = values.view(torch.int16)
        return n
    raise InvalidArgument(f"unknown delta encoding {encoding!r}")
