"""The transports registry: which kinds exist, proto translations, and refusals that say why."""

from __future__ import annotations

import pytest

from grpo.common.v1 import types_pb2
from services.common.errors import FailedPrecondition, InvalidArgument
from services.transports import TransportKind, WeightTransport
from services.transports import registry as transports

from .support import Packed


def test_every_kind_is_implemented_or_planned_and_each_module_holds_both_halves() -> None:
    assert set(transports.TRANSPORTS) | set(transports.PLANNED) == set(TransportKind)
    assert not set(transports.TRANSPORTS) & set(transports.PLANNED)
    for kind, transport in transports.TRANSPORTS.items():
        assert isinstance(transport, WeightTransport) and transport.kind == kind
        assert type(transport).__module__ == f"services.transports.{kind.value}"


@pytest.mark.parametrize("kind", list(TransportKind))
def test_kind_proto_round_trip(kind: TransportKind) -> None:
    assert transports.kind_from_proto(transports.kind_to_proto(kind)) == kind


def test_unspecified_and_unknown_proto_kinds_are_invalid() -> None:
    for value in (types_pb2.WEIGHT_TRANSPORT_KIND_UNSPECIFIED, 99):
        with pytest.raises(InvalidArgument, match="unsupported weight transport kind"):
            transports.kind_from_proto(value)


@pytest.mark.parametrize("kind", sorted(transports.PLANNED))
def test_planned_kinds_are_refused_with_the_reason(kind: TransportKind) -> None:
    with pytest.raises(FailedPrecondition, match=f"{kind} weight transport is not implemented yet"):
        transports.get(kind)


def test_target_from_proto_rejects_missing_or_planned_transport_and_bad_manifests() -> None:
    import torch

    message = Packed({"w": torch.ones(4, 4)}).weight_version(1)
    with pytest.raises(InvalidArgument, match="no transport"):
        transports.target_from_proto(message)
    message.checkpoint.path = "/ckpt"
    with pytest.raises(FailedPrecondition, match="checkpoint weight transport is not implemented yet"):
        transports.target_from_proto(message)
    message.shared_memory.segment_name = ""
    with pytest.raises(InvalidArgument, match="segment_name must be a learner"):
        transports.target_from_proto(message)
    message.grpc_stream.address = ""
    with pytest.raises(InvalidArgument, match="address must be host:port"):
        transports.target_from_proto(message)
    message.grpc_stream.address = "h:1"
    message.total_bytes += 1
    with pytest.raises(InvalidArgument, match="total_bytes"):
        transports.target_from_proto(message)
