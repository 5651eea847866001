"""services/common/checksums.py: both algorithms catch a flipped bit and moved words; wsum64 agrees
across devices and reduction orders."""

from __future__ import annotations

import pytest
import torch
import xxhash

from services.common import checksums
from services.common.checksums import ChecksumAlgorithm, digest, wsum64


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def test_wsum64_matches_its_definition_in_python_integers() -> None:
    data = _bytes(8 * 1000)
    words = data.view(torch.int64).tolist()
    expected = sum(w * (2 * i + 1) for i, w in enumerate(words)) % 2**64
    assert wsum64(data) == expected


def test_wsum64_is_the_same_whatever_the_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    data = _bytes(8 * 5000, seed=1)
    whole = wsum64(data)
    monkeypatch.setattr(checksums, "_WSUM_CHUNK_WORDS", 7)
    assert wsum64(data) == whole


@pytest.mark.parametrize("algorithm", list(ChecksumAlgorithm))
def test_a_flipped_bit_and_swapped_words_change_the_digest(algorithm: ChecksumAlgorithm) -> None:
    data = _bytes(8 * 512, seed=2)
    base = digest(algorithm, data)
    assert base == digest(algorithm, memoryview(data.numpy()))  # tensor and bytes agree
    assert len(base) == checksums.DIGEST_HEX_CHARS[algorithm]
    for position in (0, 100, 8 * 512 - 1):
        for bit in (0, 7):
            flipped = data.clone()
            flipped[position] ^= 1 << bit
            assert digest(algorithm, flipped) != base
    swapped = data.clone().view(torch.int64)
    swapped[[3, 9]] = swapped[[9, 3]]
    assert digest(algorithm, swapped.view(torch.uint8)) != base


def test_xxh3_is_the_reference_xxhash() -> None:
    data = _bytes(1000)
    assert digest(ChecksumAlgorithm.xxh3_64, data) == xxhash.xxh3_64_hexdigest(bytes(data.numpy()))


def test_wsum64_needs_whole_words() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        wsum64(_bytes(12))


@pytest.mark.gpu
def test_wsum64_on_cuda_equals_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    data = _bytes(8 * (1 << 20) + 64, seed=3)
    assert wsum64(data.cuda()) == wsum64(data)
