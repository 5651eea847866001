"""LandingCheck: bucket checksums computed while chunks land, in order or not, and corruption found."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.checksums import ChecksumAlgorithm
from services.common.errors import DataLoss
from services.common.weights import Manifest, checksum_buckets
from services.transports.landing_check import LandingCheck

BUCKET, CHUNK = 4096, 1000  # chunks that straddle nothing but end short of each bucket's end


def _source(total: int, algorithm: ChecksumAlgorithm = ChecksumAlgorithm.xxh3_64) -> tuple[bytes, Manifest]:
    data = os.urandom(total)
    buckets = checksum_buckets(memoryview(bytearray(data)), total, BUCKET, algorithm)
    return data, Manifest((), tuple(buckets), total, algorithm)


def _chunks(manifest: Manifest) -> list[tuple[int, int, int]]:
    """(bucket index, offset, size) of every chunk, bucket by bucket, each bucket front to back."""
    return [
        (b.index, offset, min(CHUNK, b.offset + b.nbytes - offset))
        for b in manifest.buckets
        for offset in range(b.offset, b.offset + b.nbytes, CHUNK)
    ]


async def _receive(source: bytes, manifest: Manifest, order: list[tuple[int, int, int]], flip: int | None):
    """Copy the chunks into a fresh buffer in `order` (the byte at `flip` corrupted), reporting each."""
    buf = memoryview(bytearray(manifest.total_bytes))
    check = LandingCheck(buf, manifest)
    missing = {b.index: b.nbytes for b in manifest.buckets}
    try:
        for index, offset, size in order:
            buf[offset : offset + size] = source[offset : offset + size]
            if flip is not None and offset <= flip < offset + size:
                buf[flip] ^= 0x01
            missing[index] -= size
            check.landed(manifest.buckets[index], offset, size, complete=missing[index] == 0)
        await check.finish()
    finally:
        await asyncio.gather(*check.stop(), return_exceptions=True)


async def test_in_order_chunks_of_intact_bytes_pass():
    source, manifest = _source(3 * BUCKET + 123)
    await _receive(source, manifest, _chunks(manifest), flip=None)


@pytest.mark.parametrize("algorithm", list(ChecksumAlgorithm))
@pytest.mark.parametrize("shuffled", [False, True])
async def test_a_flipped_bit_is_named_by_its_bucket(algorithm, shuffled):
    source, manifest = _source(3 * BUCKET + 8, algorithm)  # wsum64 needs whole int64 words
    order = _chunks(manifest)
    if shuffled:  # out of order: those buckets are verified whole once complete
        random.Random(0).shuffle(order)
    with pytest.raises(DataLoss, match="weight bucket 2 checksum mismatch"):
        await _receive(source, manifest, order, flip=2 * BUCKET + 5)


async def test_a_corrupt_bucket_stops_the_stream_early():
    """Once the thread has found bucket 0 corrupt, the next chunk that lands raises at once."""
    source, manifest = _source(4 * BUCKET)
    buf = memoryview(bytearray(manifest.total_bytes))
    check = LandingCheck(buf, manifest)
    order = _chunks(manifest)
    first = [c for c in order if c[0] == 0]
    for _, offset, size in first:
        buf[offset : offset + size] = source[offset : offset + size]
    buf[0] ^= 0x80
    for i, (index, offset, size) in enumerate(first):
        check.landed(manifest.buckets[index], offset, size, complete=i == len(first) - 1)
    try:
        with pytest.raises(DataLoss, match="weight bucket 0"):
            for _ in range(500):  # the thread hashes bucket 0 within a few ms; 5 s at most
                check.landed(manifest.buckets[1], BUCKET, CHUNK, complete=False)
                await asyncio.sleep(0.01)
    finally:
        await asyncio.gather(*check.stop(), return_exceptions=True)


@settings(max_examples=40, deadline=None)
@given(
    total=st.integers(1, 3 * BUCKET),
    seed=st.integers(0, 2**16),
    swaps=st.integers(0, 3),
    flip=st.none() | st.floats(0, 1, exclude_max=True),
)
def test_any_order_and_any_flip_property(total, seed, swaps, flip):
    """Whatever the arrival order (some swaps of chunks), intact bytes pass and a flipped bit fails."""
    source, manifest = _source(total)
    order, rng = _chunks(manifest), random.Random(seed)
    for _ in range(swaps):
        i, j = rng.randrange(len(order)), rng.randrange(len(order))
        order[i], order[j] = order[j], order[i]
    at = None if flip is None else int(flip * total)
    if at is None:
        asyncio.run(_receive(source, manifest, order, None))
    else:
        with pytest.raises(DataLoss, match=f"weight bucket {at // BUCKET} checksum mismatch"):
            asyncio.run(_receive(source, manifest, order, at))
