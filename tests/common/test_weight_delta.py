"""Sparse bucket deltas (services/common/weight_delta.py): sizes and payloads computed by hand, round
trips on bf16 weights, and a delta applied to the wrong base caught by the new bucket's checksum."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common import checksums
from services.common.checksums import ChecksumAlgorithm
from services.common.errors import DataLoss, InvalidArgument
from services.common.weight_delta import Delta, Encoding, apply, apply_tensor, encode, encode_tensor, sizes


def _u16(*values: int) -> bytes:
    return np.array(values, dtype="<u2").tobytes()


def test_sizes_of_each_encoding_by_hand() -> None:
    # 1000 bf16 words, 10 changed: whole 2000 B; indices 10 × (4 + 2) = 60 B; bitmap 125 + 10 × 2 = 145 B
    assert sizes(1000, 10, 2) == {Encoding.FULL: 2000, Encoding.INDICES: 60, Encoding.BITMAP: 145}
    # 1000 words, 200 changed: indices 1200 B, bitmap 125 + 400 = 525 B
    assert sizes(1000, 200, 2)[Encoding.BITMAP] == 525


def test_one_word_in_sixty_four_travels_as_its_index_and_value() -> None:
    base = _u16(*range(64))
    new = bytearray(base)
    new[10:12] = (7).to_bytes(2, "little")  # word 5: 5 → 7
    delta = encode(base, new, 2)
    # indices 1 × 6 = 6 B < bitmap 8 + 2 = 10 B < whole 128 B
    assert (delta.encoding, delta.changed) == (Encoding.INDICES, 1)
    assert bytes(delta.payload) == (5).to_bytes(4, "little") + (7).to_bytes(2, "little")
    target = bytearray(base)
    assert apply(target, delta, 2) == 1 and target == new


def test_a_changed_word_in_four_travels_as_a_bitmap() -> None:
    base, new = _u16(1, 2, 3, 4), _u16(1, 9, 3, 4)
    delta = encode(base, new, 2)
    # bitmap 1 + 2 = 3 B < indices 6 B < whole 8 B; bit 1 set (little-endian bit order), then the value
    assert (delta.encoding, bytes(delta.payload)) == (Encoding.BITMAP, b"\x02\x09\x00")
    target = bytearray(base)
    assert apply(target, delta, 2) == 1 and bytes(target) == new


def test_a_bucket_that_changed_everywhere_travels_whole() -> None:
    base, new = _u16(1, 2, 3, 4), _u16(5, 6, 7, 8)
    delta = encode(base, new, 2)
    assert (delta.encoding, bytes(delta.payload), delta.changed) == (Encoding.FULL, new, 4)
    target = bytearray(base)
    apply(target, delta, 2)
    assert bytes(target) == new


def test_an_unchanged_bucket_costs_no_bytes() -> None:
    base = _u16(*range(100))
    delta = encode(base, base, 2)
    assert (delta.encoding, delta.changed, len(delta.payload)) == (Encoding.INDICES, 0, 0)


@pytest.mark.parametrize("fraction", [0.0005, 0.02, 0.3, 0.9])
def test_bf16_weights_after_small_updates_round_trip_bit_for_bit(fraction: float) -> None:
    torch.manual_seed(0)
    master = torch.randn(50_000) * 0.02  # fp32 master weights
    base = master.to(torch.bfloat16)
    step = torch.zeros_like(master)
    chosen = torch.rand(master.numel()) < fraction
    step[chosen] = master[chosen] * 0.05  # large enough to move their bf16 value
    new = (master + step).to(torch.bfloat16)
    base_bytes = base.view(torch.int16).numpy().tobytes()
    new_bytes = new.view(torch.int16).numpy().tobytes()
    delta = encode(base_bytes, new_bytes, 2)
    expected = int((base.view(torch.int16) != new.view(torch.int16)).sum())
    assert delta.changed == expected
    assert len(delta.payload) == min(sizes(master.numel(), expected, 2).values())
    target = bytearray(base_bytes)
    apply(target, delta, 2)
    digest = checksums.digest(ChecksumAlgorithm.xxh3_64, memoryview(target))
    assert digest == checksums.digest(ChecksumAlgorithm.xxh3_64, memoryview(new_bytes))


def test_a_delta_applied_to_the_wrong_base_does_not_match_the_new_checksum() -> None:
    base, new, other = _u16(*range(64)), bytearray(_u16(*range(64))), bytearray(_u16(*range(64)))
    new[0:2] = (100).to_bytes(2, "little")
    other[20:22] = (1).to_bytes(2, "little")  # a receiver holding another version
    delta = encode(base, new, 2)
    apply(other, delta, 2)
    assert checksums.digest(ChecksumAlgorithm.xxh3_64, memoryview(other)) != checksums.digest(
        ChecksumAlgorithm.xxh3_64, memoryview(bytes(new))
    )


@pytest.mark.parametrize(
    "delta",
    [
        Delta(Encoding.INDICES, (64).to_bytes(4, "little") + b"\x00\x00", 1),  # word 64 of 0..63
        Delta(Encoding.INDICES, b"\x00\x00\x00", 1),  # not whole (index, word) pairs
        Delta(Encoding.BITMAP, b"\x01" * 8, 8),  # 8 bits set, no values
        Delta(Encoding.BITMAP, b"\x01", 1),  # shorter than its map
        Delta(Encoding.FULL, b"\x00" * 10, 5),  # the wrong size
    ],
)
def test_a_malformed_delta_is_data_loss_and_writes_nothing(delta: Delta) -> None:
    base = _u16(*range(64))
    target = bytearray(base)
    with pytest.raises(DataLoss):
        apply(target, delta, 2)
    assert bytes(target) == base
    tensor = torch.frombuffer(bytearray(base), dtype=torch.uint8)
    with pytest.raises(DataLoss):
        apply_tensor(tensor, delta.encoding, torch.frombuffer(bytearray(delta.payload), dtype=torch.uint8))
    assert tensor.numpy().tobytes() == base


@pytest.mark.parametrize(
    ("words", "changed"), [(1000, 0), (1001, 10), (1003, 50), (997, 498), (8, 1), (13, 13), (9, 2)]
)
def test_the_torch_encoding_is_the_wire_encoding_byte_for_byte(words: int, changed: int) -> None:
    """encode_tensor/apply_tensor (the nccl transport's, on the bucket's device) produce and read the
    same payloads as encode/apply (grpc_stream's): each encoding, odd bitmap sizes included."""
    generator = torch.Generator().manual_seed(words)
    base = torch.randint(0, 256, (2 * words,), dtype=torch.uint8, generator=generator)
    new = base.clone()
    new.view(torch.int16)[torch.randperm(words, generator=generator)[:changed]] += 1
    encoding, payload, count = encode_tensor(base, new)
    expected = encode(base.numpy().tobytes(), new.numpy().tobytes(), 2)
    assert (encoding, count) == (expected.encoding, expected.changed)
    assert (new.numpy().tobytes() if payload is None else payload.numpy().tobytes()) == bytes(
        expected.payload
    )
    rebuilt = base.clone()
    assert apply_tensor(rebuilt, encoding, new if payload is None else payload) == count
    assert torch.equal(rebuilt, new)


def test_words_must_tile_the_bucket() -> None:
    with pytest.raises(InvalidArgument, match="whole number of 2-byte words"):
        encode(b"\x00" * 3, b"\x00" * 3, 2)
    with pytest.raises(InvalidArgument, match="one size"):
        encode(b"\x00" * 4, b"\x00" * 6, 2)
