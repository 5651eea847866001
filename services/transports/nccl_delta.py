"""Sparse deltas over the `nccl` transport (see `nccl.py`): a broadcast of bf16/fp16 weights that sends,
per bucket, only the words that changed since a base version every member holds.

A broadcast reaches every member at once, so it can send deltas only when every member holds the same
base. The learner keeps a copy of the last version it packed (`Base`, on its device) and, while it
checksums each bucket of the next version in PrepareWeights, also diffs it against that copy
(`weight_delta.encode_tensor`) and keeps the encoded payloads. The descriptor lists each bucket's
encoding and payload size. At the broadcast's roll call each worker writes what its receive buffer
holds (`holding`: the version and `weight_delta.base_digest` of its last verified receive, or nothing);
the learner's verdict says `delta` only when every member holds exactly the base, and then broadcasts
the payloads (whole buckets where a delta would not be smaller); otherwise every bucket whole.

A worker rebuilds each delta bucket in place over its buffer and verifies the result against the new
version's bucket checksum like any received bucket: a worker whose buffer was not the base after all
fails the version with DATA_LOSS, and since a receive forgets what the buffer held until it verifies,
the next broadcast (the scheduler's retry) is sent whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from grpo.common.v1 import types_pb2
from services.common import weight_delta, weights
from services.common.errors import InvalidArgument
from services.common.weight_delta import Encoding
from services.transports.process_group import SealedStore


@dataclass
class Base:
    """The learner's copy of the last version it packed: the base of the next version's deltas."""

    version: int
    manifest: weights.Manifest
    buffer: torch.Tensor  # [total_bytes] uint8 on the learner's device

    def fits(self, entries: list[weights.TensorEntry], ranges: list[tuple[int, int, int]]) -> bool:
        """Whether a version of this layout (tensors, bucket ranges) can be diffed against this base."""
        return self.manifest.tensors == tuple(entries) and [
            (b.index, b.offset, b.nbytes) for b in self.manifest.buckets
        ] == list(ranges)

    @property
    def named(self) -> tuple[int, str]:
        """(version, base digest): what a WeightVersion's delta_base_version/_digest say of it."""
        return self.version, weight_delta.base_digest(self.manifest)


@dataclass(frozen=True)
class BucketDelta:
    """How one bucket travels when the broadcast sends deltas."""

    encoding: Encoding
    payload_bytes: int
    payload: torch.Tensor | None = None  # learner only: the encoded bytes (None: the whole bucket)

    def described(self) -> BucketDelta:
        """What the descriptor says of it (no payload)."""
        return BucketDelta(self.encoding, self.payload_bytes)


def holding(version: int, digest: str) -> str:
    """Names a version's bytes (its number, `weight_delta.base_digest`) as the roll call compares them."""
    return f"{version}:{digest}"


def delta_eligible(entries: list[weights.TensorEntry], total: int) -> bool:
    """bf16/fp16 tensors only (fp32 changes almost every word each step)."""
    return weight_delta.delta_word(weights.Manifest(tuple(entries), (), total)) is not None


def encode(base: Base, start: int, data: torch.Tensor) -> BucketDelta:
    """The bucket `data` (packed at `start`) against the same bytes of `base`."""
    encoding, payload, _ = weight_delta.encode_tensor(base.buffer[start : start + data.numel()], data)
    return BucketDelta(encoding, data.numel() if payload is None else payload.numel(), payload)


def every_member_holds(keys: SealedStore, world: int, base: str) -> bool:
    """Rank 0, once everyone joined the roll call: whether every member wrote that it holds `base`."""
    for rank in range(1, world):
        if not keys.check([f"holds/{rank}"]) or keys.get(f"holds/{rank}").decode(errors="replace") != base:
            return False
    return True


def say_holding(keys: SealedStore, rank: int, held: str) -> None:
    """A member, before it joins the roll call: what its receive buffer holds ("" nothing)."""
    keys.set(f"holds/{rank}", held)


def to_plain(deltas: tuple[BucketDelta, ...]) -> list[list[int]]:
    return [[int(d.encoding), d.payload_bytes] for d in deltas]


def from_plain(plain: list[Any] | None) -> tuple[BucketDelta, ...]:
    return tuple(BucketDelta(Encoding(int(e)), int(n)) for e, n in plain or ())


def from_proto(message: types_pb2.WeightVersion) -> tuple[str, tuple[BucketDelta, ...]]:
    """A descriptor's delta fields: (its base's `holding` name, one BucketDelta per bucket), checked
    against the version's buckets; ("", ()) when it has none."""
    plain = message.nccl.bucket_deltas
    if not plain:
        return "", ()
    if not message.delta_base_version or not message.delta_base_digest:
        raise InvalidArgument(
            "weight_version.nccl.bucket_deltas need delta_base_version and delta_base_digest"
        )
    if len(plain) != len(message.buckets):
        raise InvalidArgument(
            f"weight_version.nccl.bucket_deltas has {len(plain)} entries for {len(message.buckets)} buckets"
        )
    out = []
    for entry, bucket in zip(plain, message.buckets, strict=True):
        if entry.encoding not in Encoding._value2member_map_:
            raise InvalidArgument(f"weight_version.nccl.bucket_deltas: unknown encoding {entry.encoding}")
        encoding = Encoding(entry.encoding)
        if encoding is Encoding.FULL and entry.payload_bytes != bucket.nbytes:
            raise InvalidArgument(
                f"weight_version.nccl.bucket_deltas: a whole bucket of {bucket.nbytes} bytes "
                f"says {entry.payload_bytes}"
            )
        if encoding is not Encoding.FULL and entry.payload_bytes >= bucket.nbytes:
            raise InvalidArgument(
                f"weight_version.nccl.bucket_deltas: a delta of {entry.payload_bytes} bytes for a bucket "
                f"of {bucket.nbytes} (a delta is sent only when smaller)"
            )
        out.append(BucketDelta(encoding, entry.payload_bytes))
    return holding(message.delta_base_version, message.delta_base_digest), tuple(out)
