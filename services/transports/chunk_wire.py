"""The `FetchWeights` stream's bytes without protobuf's copies: a weight chunk is encoded from a view of
the learner's buffer and decoded into a view of the received message.

Building `FetchWeightsResponse(chunk=WeightChunk(data=...))` copies a chunk's bytes three times (into the
field, into the outer message, into the serialized string) and reading `response.chunk.data` twice more
(parsing, then the field access); profiled on the 221 MiB benchmark model these copies, not the socket,
held the stream at ~0.5 of a raw gRPC byte stream. Here the learner writes the protobuf wire format
itself (one copy: header and data joined into the message bytes gRPC sends) and the rollout reads it
without building a message (the data stays a `memoryview` of the bytes gRPC received until it is copied
into the segment). The wire format is protobuf's own: any protobuf client (grpcurl, another language)
reads these messages, and the decoder takes any valid encoding of them (fields in any order, unknown
fields skipped, packed or not). Field numbers come from the generated descriptors, so the protos stay
the source of truth; `tests/transports/test_chunk_wire.py` checks both directions against protobuf.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2
from services.common.errors import DataLoss

_CHUNK_FIELDS = types_pb2.WeightChunk.DESCRIPTOR.fields_by_name
_VERSION = _CHUNK_FIELDS["version"].number
_BUCKET = _CHUNK_FIELDS["bucket"].number
_OFFSET = _CHUNK_FIELDS["offset"].number
_DATA = _CHUNK_FIELDS["data"].number
_ENCODING = _CHUNK_FIELDS["encoding"].number
_PAYLOAD_BYTES = _CHUNK_FIELDS["payload_bytes"].number
_NUMBERS = (_VERSION, _BUCKET, _OFFSET, _ENCODING, _PAYLOAD_BYTES)
_CHUNK = learner_pb2.FetchWeightsResponse.DESCRIPTOR.fields_by_name["chunk"].number
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_SERVICE = learner_pb2.DESCRIPTOR.services_by_name["LearnerService"]
FETCH_PATH = f"/{_SERVICE.full_name}/{_SERVICE.methods_by_name['FetchWeights'].name}"


@dataclass(frozen=True)
class ChunkView:
    """One received `WeightChunk`; `data` is a view of the message gRPC delivered (no copy)."""

    version: int
    bucket: int
    offset: int
    data: memoryview
    encoding: int = 0  # BucketEncoding: 0 the bucket's bytes, else a delta (offset within its payload)
    payload_bytes: int = 0  # a delta's whole payload


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64: two's complement, as protobuf encodes negative values
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def encode_chunk(
    version: int,
    bucket: int,
    offset: int,
    data: memoryview | bytes,
    encoding: int = 0,
    payload_bytes: int = 0,
) -> bytes:
    """A serialized `FetchWeightsResponse{chunk: WeightChunk{version, bucket, offset, data, encoding,
    payload_bytes}}`; the only copy of `data` is the one into the returned bytes."""

    def varints(*fields: tuple[int, int]) -> bytes:
        # proto3: default values are not written
        return b"".join(_tag(field, _VARINT) + _varint(value) for field, value in fields if value)

    # in field-number order, as protobuf writes them: 1-3, data (4), then 5-6
    head = varints((_VERSION, version), (_BUCKET, bucket), (_OFFSET, offset))
    tail = varints((_ENCODING, encoding), (_PAYLOAD_BYTES, payload_bytes))
    size = len(data)
    body = len(head) + (len(_tag(_DATA, _LEN)) + len(_varint(size)) + size if size else 0) + len(tail)
    parts: list[Any] = [_tag(_CHUNK, _LEN), _varint(body), head]
    if size:
        parts += [_tag(_DATA, _LEN), _varint(size), data]
    parts.append(tail)
    return b"".join(parts)


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise DataLoss("FetchWeights response: a truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int) -> Iterable[tuple[int, int, int | memoryview]]:
    """(field, wire type, value) of every field in buf[pos:end]; LEN values are views."""
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, end)
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos, end)
            if pos + length > end:
                raise DataLoss(f"FetchWeights response: field {field} runs past the message end")
            value, pos = buf[pos : pos + length], pos + length
        elif wire_type in (_I64, _I32):
            width = 8 if wire_type == _I64 else 4
            if pos + width > end:
                raise DataLoss(f"FetchWeights response: field {field} runs past the message end")
            value, pos = int.from_bytes(buf[pos : pos + width], "little"), pos + width
        else:
            raise DataLoss(f"FetchWeights response: unsupported wire type {wire_type} (field {field})")
        yield field, wire_type, value


def decode_chunk(raw: bytes) -> ChunkView:
    """A `FetchWeightsResponse` from its wire bytes, its chunk's data a view of `raw`; as protobuf
    parses: the last value of a repeated scalar field wins, sub-message pieces merge."""
    buf = memoryview(raw)
    version = bucket = offset = encoding = payload_bytes = 0
    data = memoryview(b"")
    for field, wire_type, outer in _fields(buf, 0, len(buf)):
        if field != _CHUNK:
            continue  # unknown fields of the response
        if wire_type != _LEN:
            raise DataLoss(f"FetchWeights response: field chunk has wire type {wire_type}")
        assert isinstance(outer, memoryview)
        for inner, inner_type, value in _fields(outer, 0, len(outer)):
            expected = _LEN if inner == _DATA else _VARINT
            if inner not in (*_NUMBERS, _DATA):
                continue
            if inner_type != expected:
                raise DataLoss(f"FetchWeights response: WeightChunk field {inner} has wire type {inner_type}")
            if inner == _DATA:
                assert isinstance(value, memoryview)
                data = value
            elif inner == _VERSION:
                version = value - (1 << 64) if value >= 1 << 63 else value  # int64
            elif inner == _BUCKET:
                bucket = value & 0xFFFFFFFF  # uint32: protobuf truncates
            elif inner == _ENCODING:
                encoding = value & 0xFFFFFFFF  # an enum is an int32
            elif inner == _PAYLOAD_BYTES:
                payload_bytes = value
            else:
                offset = value
    return ChunkView(version, bucket, offset, data, encoding, payload_bytes)


def _pass_encoded(serializer: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    def serialize(message: Any) -> bytes:
        return message if isinstance(message, bytes) else serializer(message)

    return serialize


def _passing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    return handler._replace(response_serializer=_pass_encoded(handler.response_serializer))


class _GenericPassing(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, paths: frozenset[str]) -> None:
        self.inner, self.paths = inner, paths

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self.inner.service(handler_call_details)
        if handler is not None and handler_call_details.method in self.paths:
            return _passing(handler)
        return handler


class PreEncodedResponses:
    """A server as the generated `add_*Servicer_to_server` sees it, whose handlers for `paths` also
    send a response that is already wire bytes (the servicer yields `encode_chunk(...)`) as it is."""

    def __init__(self, server: grpc.aio.Server, paths: Iterable[str]) -> None:
        self.server, self.paths = server, frozenset(paths)

    def add_generic_rpc_handlers(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self.server.add_generic_rpc_handlers(tuple(_GenericPassing(h, self.paths) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        passing = {
            name: _passing(h) if f"/{service}/{name}" in self.paths else h for name, h in handlers.items()
        }
        self.server.add_registered_method_handlers(service, passing)
