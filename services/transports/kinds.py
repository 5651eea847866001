"""The torch-free part of the transport contract: what the scheduler (which never touches weights)
needs to name transports, receivers and how long a collective transfer may take.

Importing this module, or the `services.transports` package itself, loads no torch: the package
resolves its torch-backed names (`base.py`) on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated

from pydantic import AfterValidator

from grpo.common.v1 import types_pb2
from services.common.deadlines import TransferDeadline
from services.common.errors import InvalidArgument


class TransportKind(StrEnum):
    """How rollouts receive a weight version; the values are the `WeightVersion.transport` oneof names
    (member names equal values, so `--help` lists what users type)."""

    grpc_stream = "grpc_stream"
    shared_memory = "shared_memory"
    cuda_ipc = "cuda_ipc"
    nccl = "nccl"
    checkpoint = "checkpoint"


# Kinds the contract describes but no module implements yet, with where they would work.
PLANNED: dict[TransportKind, str] = {
    TransportKind.checkpoint: "a shared file system: rollouts load a safetensors checkpoint",
}


@dataclass(frozen=True)
class Receiver:
    """A rollout that receives a version through a collective transport."""

    rollout_id: str
    instance_id: str  # changes when the rollout restarts
    workers: int  # its processes that join the group


def not_implemented(kind: TransportKind) -> str:
    """Why `kind` cannot be used (empty when it can)."""
    return f"{kind} weight transport is not implemented yet ({PLANNED[kind]})" if kind in PLANNED else ""


def _implemented(kind: TransportKind) -> TransportKind:
    if why := not_implemented(kind):
        raise ValueError(why)
    return kind


# A settings field type: a transport this build implements (a planned one fails at start-up, with why).
ImplementedTransport = Annotated[TransportKind, AfterValidator(_implemented)]


def kind_to_proto(kind: TransportKind) -> types_pb2.WeightTransportKind.ValueType:
    return types_pb2.WeightTransportKind.Value(f"WEIGHT_TRANSPORT_KIND_{kind.value.upper()}")


def kind_from_proto(value: int) -> TransportKind:
    """The kind named by a `WeightTransportKind` enum value (InvalidArgument for UNSPECIFIED/unknown)."""
    try:
        name = types_pb2.WeightTransportKind.Name(value)
    except ValueError:
        name = ""
    kind = name.removeprefix("WEIGHT_TRANSPORT_KIND_").lower()
    if kind not in TransportKind.__members__.values():
        names = ", ".join(k.name for k in TransportKind)
        raise InvalidArgument(f"unsupported weight transport kind {value} (use one of {names})")
    return TransportKind(kind)


MESH_SLACK_S = 2.0  # joining: beyond the deadline, for the connect path's own timeout to fire first


def join_bound_s(deadline_seconds: float) -> float:
    """The most joining a weight-sync broadcast may take (see `process_group.py`): a member first
    waits up to `MESH_SLACK_S` for its previous, cancelled receive to end, then up to two deadlines
    for the roll call's verdict (rank 0 may arrive one deadline late, then waits one), then a new
    group's connection mesh has one deadline plus `MESH_SLACK_S`."""
    return 3 * deadline_seconds + 2 * MESH_SLACK_S


def transfer_deadline(floor_s: float, min_rate_mb_s: float) -> TransferDeadline:
    """The buckets' deadline of an nccl descriptor; 0 (a learner that sent none) means the defaults."""
    defaults = TransferDeadline()
    return TransferDeadline(
        floor_s=floor_s if floor_s > 0 else defaults.floor_s,
        min_rate_mb_s=min_rate_mb_s if min_rate_mb_s > 0 else defaults.min_rate_mb_s,
    )


def collective_receive_s(deadline_seconds: float, transfer_s: float) -> float:
    """The most a collective receive may take: joining, then `transfer_s` for all the buckets."""
    return join_bound_s(deadline_seconds) + transfer_s


def receive_bound_s(message: types_pb2.WeightVersion) -> float | None:
    """How long staging `message` may take by its transport's own deadlines (joining, then the
    buckets' transfer deadline for `total_bytes`); None when the transport has none (the caller's
    timeout applies). Pure: reads only the message."""
    if message.WhichOneof("transport") != "nccl":
        return None
    field = message.nccl
    transfer = transfer_deadline(field.transfer_floor_s, field.transfer_min_rate_mb_s)
    return collective_receive_s(field.deadline_seconds, transfer.for_bytes(message.total_bytes))
