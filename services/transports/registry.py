"""Which weight transports exist, keyed by kind, and the proto translations every service shares.

`TRANSPORTS` holds the implemented ones; `PLANNED` names the kinds the contract already describes
but no module implements yet, with where they would work. Adding a transport is one module with its
three halves (see `base.py`) plus one line here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch

from grpo.common.v1 import types_pb2
from services.common import weights
from services.common.errors import FailedPrecondition, InvalidArgument
from services.transports.base import LoadPlan, Prepared, StageTarget, WeightTransport, WorkerContext
from services.transports.cuda_ipc import CudaIpcTransport
from services.transports.grpc_stream import GrpcStreamTransport
from services.transports.kinds import (  # re-exported: one place to look things up
    PLANNED,
    ImplementedTransport,
    TransportKind,
    kind_from_proto,
    kind_to_proto,
    not_implemented,
)
from services.transports.nccl import NcclTransport
from services.transports.shared_memory import SharedMemoryTransport

TRANSPORTS: dict[TransportKind, WeightTransport] = {
    t.kind: t for t in (GrpcStreamTransport(), SharedMemoryTransport(), NcclTransport(), CudaIpcTransport())
}

__all__ = [
    "PLANNED",
    "TRANSPORTS",
    "ImplementedTransport",
    "LocalWorkers",
    "describe",
    "get",
    "kind_from_proto",
    "kind_to_proto",
    "open_tensors",
    "target_from_proto",
    "worker_op",
]


def get(kind: TransportKind | str) -> WeightTransport:
    """The transport of `kind`; FailedPrecondition for a planned kind, InvalidArgument for an unknown one."""
    try:
        kind = TransportKind(kind)
    except ValueError:
        raise InvalidArgument(f"unknown weight transport {kind!r}") from None
    if why := not_implemented(kind):
        raise FailedPrecondition(why)
    return TRANSPORTS[kind]


def close_all() -> None:
    """Free what every transport's rollout half keeps between versions (at the rollout's shutdown)."""
    for transport in TRANSPORTS.values():
        transport.close()


def describe(prepared: Prepared, adapter: weights.LoraSpec | None = None) -> types_pb2.WeightVersion:
    """The WeightVersion message of a prepared version: manifest, checksums and its transport field;
    `adapter` when its tensors are a LoRA adapter (the learner knows; transports move bytes only)."""
    message = types_pb2.WeightVersion(version=prepared.version, parent_version=prepared.version - 1)
    weights.manifest_to_proto(prepared.manifest, message)
    weights.adapter_to_proto(adapter, message)
    get(prepared.kind).write_descriptor(prepared, message)
    return message


def target_from_proto(message: types_pb2.WeightVersion) -> StageTarget:
    """Manifest + transport of a WeightVersion, validated (InvalidArgument when malformed,
    FailedPrecondition for a transport this build does not implement)."""
    manifest = weights.manifest_from_proto(message)
    field = message.WhichOneof("transport")
    if field is None:
        raise InvalidArgument("weight_version has no transport set")
    transport = get(field)
    return StageTarget(message.version, manifest, transport.kind, transport.read_descriptor(message))


def open_tensors(
    plan: LoadPlan, tensors: list[weights.TensorEntry], worker: WorkerContext
) -> AbstractContextManager[Iterator[tuple[str, torch.Tensor]]]:
    """(name, tensor) views of a staged version in the loading process (see WeightTransport.open_tensors)."""
    return get(plan.kind).open_tensors(plan.spec, tensors, worker)


class LocalWorkers:
    """Workers that live in this process (the transformers engine; tests and benchmarks): each
    operation runs in a thread, so a collective receive never blocks the event loop."""

    def __init__(self, *workers: WorkerContext) -> None:
        self.workers = list(workers)

    async def call_workers(self, kind: str, op: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
        return [await asyncio.to_thread(worker_op, kind, op, spec, w) for w in self.workers]


def worker_op(kind: str, op: str, spec: dict[str, Any], worker: WorkerContext) -> dict[str, Any]:
    """Transport `kind`'s operation `op` inside one worker (see WeightTransport.worker_op)."""
    return get(kind).worker_op(op, spec, worker)
