"""services/common/weights.py: packing, checksums, chunking, manifest protos, shared memory."""

from __future__ import annotations

import json

import pytest
import torch
import xxhash

from grpo.common.v1 import types_pb2
from services.common.errors import DataLoss, InvalidArgument
from services.common.weights import (
    CHUNK_BYTES,
    build_manifest,
    chunk_ranges,
    iter_tensors,
    manifest_from_plain,
    manifest_from_proto,
    manifest_to_plain,
    manifest_to_proto,
    pack_range,
    packed_size,
    plan_layout,
    tensor_views,
    verify_buckets,
)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5, generator=gen),  # 140 B: forces padding to 64-byte alignment
        "norm.weight": torch.randn(3, generator=gen).to(torch.bfloat16),
        "positions": torch.arange(-5, 6, dtype=torch.int64).reshape(11, 1),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "lm_head.weight": torch.randn(5, 7, generator=gen).t(),  # non-contiguous
    }


def _pack(state: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[bytearray, object]:
    buffer = bytearray(packed_size(plan_layout(state)))
    return buffer, build_manifest(state, memoryview(buffer), bucket_bytes=bucket_bytes)


def test_pack_verify_iter_roundtrip_across_dtypes() -> None:
    state = _state()
    buffer, manifest = _pack(state, bucket_bytes=128)
    assert len(manifest.buckets) > 1
    assert all(t.offset % 64 == 0 for t in manifest.tensors)
    verify_buckets(memoryview(buffer), manifest)
    rebuilt = dict(iter_tensors(memoryview(buffer), manifest.tensors))
    assert list(rebuilt) == list(state)  # order preserved
    for name, tensor in state.items():
        assert rebuilt[name].dtype == tensor.dtype, name
        assert rebuilt[name].shape == tensor.shape, name
        assert torch.equal(rebuilt[name], tensor), name


@pytest.mark.parametrize("bucket_bytes", [64, 100, 128, 1 << 20])
def test_pack_range_tiles_the_same_bytes_as_pack_into(bucket_bytes: int) -> None:
    # the collective transports pack bucket by bucket into a reused tensor; any tiling, even one that
    # cuts tensors mid-way, must reproduce the host packing byte for byte (padding zeroed)
    state = _state()
    expected, manifest = _pack(state, bucket_bytes=bucket_bytes)
    entries = list(manifest.tensors)
    staging = torch.full((bucket_bytes,), 0xAB, dtype=torch.uint8)  # dirty: padding must be re-zeroed
    got = bytearray()
    for start in range(0, manifest.total_bytes, bucket_bytes):
        size = min(bucket_bytes, manifest.total_bytes - start)
        got += pack_range(state, entries, start, staging[:size]).numpy().tobytes()
    assert got == expected
    views = dict(tensor_views(torch.frombuffer(bytearray(got), dtype=torch.uint8), entries))
    for name, tensor in state.items():
        assert torch.equal(views[name], tensor), name


def test_manifest_plain_data_roundtrip() -> None:
    # what crosses vLLM's collective_rpc into workers: plain lists, ints and strings only
    _, manifest = _pack(_state(), bucket_bytes=128)
    plain = manifest_to_plain(manifest)
    assert json.loads(json.dumps(plain)) == plain
    assert manifest_from_plain({**plain, "version": 3}) == manifest


def test_tensor_views_reject_a_short_buffer() -> None:
    _, manifest = _pack(_state(), bucket_bytes=128)
    with pytest.raises(InvalidArgument, match="outside the weight buffer"):
        list(tensor_views(torch.zeros(manifest.total_bytes - 64, dtype=torch.uint8), manifest.tensors))


def test_checksum_mismatch_names_the_bucket() -> None:
    buffer, manifest = _pack(_state(), bucket_bytes=128)
    buffer[200] ^= 0xFF  # inside bucket 1 = [128, 256)
    with pytest.raises(DataLoss, match="bucket 1 checksum mismatch"):
        verify_buckets(memoryview(buffer), manifest)


def test_buckets_hash_their_exact_ranges() -> None:
    buffer, manifest = _pack(_state(), bucket_bytes=100)
    assert [b.index for b in manifest.buckets] == list(range(len(manifest.buckets)))
    assert sum(b.nbytes for b in manifest.buckets) == manifest.total_bytes == len(buffer)
    for b in manifest.buckets:
        assert b.digest == xxhash.xxh3_64_hexdigest(bytes(buffer[b.offset : b.offset + b.nbytes]))


def test_chunk_ranges_cover_each_bucket_exactly_in_small_chunks() -> None:
    state = {"big": torch.zeros((5 << 20) // 4 + 3, dtype=torch.float32)}  # ~5 MiB, not a multiple of 1 MiB
    buffer, manifest = _pack(state, bucket_bytes=(2 << 20) + 64)
    chunks = list(chunk_ranges(manifest.buckets))
    assert max(size for _, _, size in chunks) <= CHUNK_BYTES
    position = 0
    for index, offset, size in chunks:
        bucket = manifest.buckets[index]
        assert offset == position, "chunks must be contiguous and in order"
        assert bucket.offset <= offset and offset + size <= bucket.offset + bucket.nbytes
        position += size
    assert position == manifest.total_bytes == len(buffer)


def test_manifest_proto_roundtrip() -> None:
    _, manifest = _pack(_state(), bucket_bytes=128)
    message = types_pb2.WeightVersion(version=3)
    manifest_to_proto(manifest, message)
    wire = types_pb2.WeightVersion.FromString(message.SerializeToString())
    assert manifest_from_proto(wire) == manifest


def _proto(bucket_bytes: int = 128) -> types_pb2.WeightVersion:
    _, manifest = _pack(_state(), bucket_bytes=bucket_bytes)
    message = types_pb2.WeightVersion(version=1)
    manifest_to_proto(manifest, message)
    return message


def _empty(message: types_pb2.WeightVersion) -> None:
    del message.tensors[:]


def _total_off(message: types_pb2.WeightVersion) -> None:
    message.total_bytes += 64


def _bucket_gap(message: types_pb2.WeightVersion) -> None:
    message.buckets[0].nbytes -= 8  # same sum of sizes, but [b0.end, b1.offset) is uncovered
    message.buckets[-1].nbytes += 8


def _bucket_index(message: types_pb2.WeightVersion) -> None:
    message.buckets[1].index = 5


def _bad_dtype(message: types_pb2.WeightVersion) -> None:
    message.tensors[0].dtype = "complex32"


def _outside(message: types_pb2.WeightVersion) -> None:
    message.tensors[-1].offset = message.total_bytes


def _nbytes_vs_shape(message: types_pb2.WeightVersion) -> None:
    message.tensors[0].shape[0] += 1


def _duplicate(message: types_pb2.WeightVersion) -> None:
    message.tensors[1].name = message.tensors[0].name


def _short_digest(message: types_pb2.WeightVersion) -> None:
    message.buckets[0].digest = message.buckets[0].digest[:8]


def _no_algorithm(message: types_pb2.WeightVersion) -> None:
    message.checksum_algorithm = types_pb2.CHECKSUM_ALGORITHM_UNSPECIFIED


@pytest.mark.parametrize(
    ("corrupt", "message_part"),
    [
        (_empty, "empty manifest"),
        (_total_off, "total_bytes"),
        (_bucket_gap, "bucket 1 covers"),
        (_bucket_index, "has index 5"),
        (_bad_dtype, "complex32"),
        (_outside, "outside the weight buffer"),
        (_nbytes_vs_shape, "nbytes"),
        (_duplicate, "appears twice"),
        (_short_digest, "16 lower-case hex digits"),
        (_no_algorithm, "unknown checksum_algorithm"),
    ],
)
def test_inconsistent_manifest_rejected(corrupt, message_part: str) -> None:
    message = _proto()
    manifest_from_proto(message)  # consistent before the corruption
    corrupt(message)
    with pytest.raises(InvalidArgument, match=message_part):
        manifest_from_proto(message)
