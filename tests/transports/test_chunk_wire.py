"""The FetchWeights wire codec against protobuf itself, both ways: whatever `encode_chunk` writes,
protobuf parses to the same message; whatever protobuf (or any valid encoder) writes, `decode_chunk`
reads as protobuf does. And the learner's FetchWeights really sends what it encoded, through gRPC."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2
from services.common.errors import DataLoss
from services.transports.chunk_wire import decode_chunk, encode_chunk

VERSIONS = st.integers(min_value=-(2**63), max_value=2**63 - 1)
BUCKETS = st.integers(min_value=0, max_value=2**32 - 1)
OFFSETS = st.integers(min_value=0, max_value=2**64 - 1)
DATA = st.binary(max_size=3000)


def _message(
    version: int, bucket: int, offset: int, data: bytes, encoding: int = 0, payload_bytes: int = 0
) -> learner_pb2.FetchWeightsResponse:
    chunk = types_pb2.WeightChunk(
        version=version,
        bucket=bucket,
        offset=offset,
        data=data,
        encoding=encoding,
        payload_bytes=payload_bytes,
    )
    return learner_pb2.FetchWeightsResponse(chunk=chunk)


@settings(max_examples=200)
@given(VERSIONS, BUCKETS, OFFSETS, DATA)
def test_what_we_encode_protobuf_parses_and_it_is_protobufs_own_encoding(version, bucket, offset, data):
    wire = encode_chunk(version, bucket, offset, memoryview(data))
    expected = _message(version, bucket, offset, data)
    assert learner_pb2.FetchWeightsResponse.FromString(wire) == expected
    assert wire == expected.SerializeToString(deterministic=True)  # byte for byte, field order included


@settings(max_examples=200)
@given(VERSIONS, BUCKETS, OFFSETS, DATA)
def test_what_protobuf_encodes_we_decode(version, bucket, offset, data):
    chunk = decode_chunk(_message(version, bucket, offset, data).SerializeToString())
    assert (chunk.version, chunk.bucket, chunk.offset, bytes(chunk.data)) == (version, bucket, offset, data)


ENCODINGS = st.sampled_from([0, 1, 2])


@settings(max_examples=200)
@given(VERSIONS, BUCKETS, OFFSETS, DATA, ENCODINGS, OFFSETS)
def test_a_delta_chunk_round_trips_and_is_protobufs_own_encoding(
    version, bucket, offset, data, encoding, payload_bytes
):
    wire = encode_chunk(version, bucket, offset, memoryview(data), encoding, payload_bytes)
    expected = _message(version, bucket, offset, data, encoding, payload_bytes)
    assert wire == expected.SerializeToString(deterministic=True)
    chunk = decode_chunk(expected.SerializeToString())
    got = (chunk.version, chunk.bucket, chunk.offset, bytes(chunk.data), chunk.encoding, chunk.payload_bytes)
    assert got == (version, bucket, offset, data, encoding, payload_bytes)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    return bytes([*out, value])


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    """A field as protobuf's wire format has it (LEN payloads get their length prefix here)."""
    return _varint(number << 3 | wire_type) + (_varint(len(payload)) + payload if wire_type == 2 else payload)


@settings(max_examples=100)
@given(st.permutations(range(4)), st.lists(st.binary(max_size=16), max_size=3), OFFSETS, DATA)
def test_fields_in_any_order_and_unknown_fields_decode_as_protobuf_does(order, unknown, offset, data):
    fields = [
        types_pb2.WeightChunk(version=3).SerializeToString(),
        types_pb2.WeightChunk(bucket=1).SerializeToString(),
        _field(3, 0, _varint(offset)),  # written even when 0, as another encoder may
        _field(4, 2, data),
    ]
    body = b"".join(fields[i] for i in order)
    body += b"".join(_field(15 + i, 2, blob) for i, blob in enumerate(unknown))  # a newer proto's fields
    wire = _field(1, 2, body) + _field(9, 0, b"\x05")  # and an unknown field of the response
    parsed = learner_pb2.FetchWeightsResponse.FromString(wire).chunk  # the encoding is valid protobuf
    assert (parsed.version, parsed.bucket, parsed.offset, parsed.data) == (3, 1, offset, data)
    chunk = decode_chunk(wire)
    assert (chunk.version, chunk.bucket, chunk.offset, bytes(chunk.data)) == (3, 1, offset, data)


@pytest.mark.parametrize(
    "wire, problem",
    [
        (_field(1, 2, _field(4, 2, b"abc"))[:-1], "runs past the message end"),
        (b"\x0a\x80", "truncated or overlong varint"),
        (_field(1, 0, b"\x01"), "field chunk has wire type 0"),
        (_field(1, 2, _field(4, 0, b"\x01")), "WeightChunk field 4 has wire type 0"),
        (_field(1, 2, b"\x0b"), "unsupported wire type 3"),
    ],
)
def test_malformed_responses_are_data_loss(wire: bytes, problem: str) -> None:
    with pytest.raises(DataLoss, match=problem):
        decode_chunk(wire)


def test_the_data_is_a_view_of_the_received_bytes_not_a_copy() -> None:
    wire = encode_chunk(1, 0, 0, memoryview(b"x" * 1000))
    chunk = decode_chunk(wire)
    assert chunk.data.obj is wire
