"""The weight-transport contract: what every transport provides, on each side of a sync.

A weight version travels learner → rollout in three halves, all in one module per transport:

    learner half   prepare(version, state) → Prepared     pack a snapshot into the medium (model thread)
                   write_descriptor(prepared, message)    how to reach it, into WeightVersion's oneof
    rollout half   read_descriptor(message) → descriptor  the same fields back, validated
                   await stage(target, ctx) → Staged      fetch/attach + verify checksums (event loop)
    engine half    open_tensors(spec, tensors)             (name, tensor) views where the engine loads:
                                                           the HF engine thread or each vLLM worker

`Staged.plan` is plain data (a `LoadPlan`: a transport kind and a JSON-like spec) because it crosses
vLLM's `collective_rpc` into worker processes: no pickle, no tensors, no dtypes objects. A transport
that lands its bytes somewhere another transport can read (grpc_stream fetches into a shared-memory
segment) hands over a plan of that other kind, so engines have one load path per medium.

The scheduler only coordinates (it never looks inside a descriptor); the byte layout, checksums and
manifest are common to all transports (`services/common/weights.py`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import torch

from grpo.common.v1 import types_pb2
from services.common.weights import Manifest, TensorEntry


class TransportKind(StrEnum):
    """How rollouts receive a weight version; the values are the `WeightVersion.transport` oneof names
    (member names equal values, so `--help` lists what users type)."""

    grpc_stream = "grpc_stream"
    shared_memory = "shared_memory"
    cuda_ipc = "cuda_ipc"
    nccl = "nccl"
    checkpoint = "checkpoint"


@dataclass(frozen=True)
class PublishContext:
    """What the learner half may need from the learner service (resolved lazily: only when used)."""

    run_id: str
    bucket_bytes: int
    chunk_bytes: int
    advertise_address: Callable[[], str]  # host:port of the learner; raises FailedPrecondition if unknown


class Prepared(abc.ABC):
    """One packed version on the learner, held until released."""

    kind: ClassVar[TransportKind]

    def __init__(self, version: int, manifest: Manifest) -> None:
        self.version = version
        self.manifest = manifest

    @abc.abstractmethod
    def view(self) -> memoryview:
        """The packed bytes (the learner's FetchWeights serves any prepared version from here)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Free the medium (idempotent)."""


@dataclass(frozen=True)
class StageContext:
    """What the rollout half may need from the rollout service."""

    rollout_id: str
    fetch_timeout_s: float


@dataclass(frozen=True)
class StageTarget:
    """A published version to stage: version, manifest, and the transport's own descriptor."""

    version: int
    manifest: Manifest
    kind: TransportKind
    descriptor: Any


@dataclass(frozen=True)
class LoadPlan:
    """How an engine opens a staged version: a transport kind and a plain-data spec (crosses RPC)."""

    kind: TransportKind
    spec: dict[str, Any]


class Staged(abc.ABC):
    """A fetched and verified version on the rollout, waiting for its commit."""

    def __init__(self, version: int, manifest: Manifest, fetch_ms: float) -> None:
        self.version = version
        self.manifest = manifest
        self.fetch_ms = fetch_ms

    @property
    @abc.abstractmethod
    def plan(self) -> LoadPlan:
        """Where the engine loads it from."""

    @abc.abstractmethod
    def release(self) -> None:
        """Drop the staged bytes (safe to call twice)."""


class WeightTransport(abc.ABC):
    """One transport: its learner, rollout and engine halves (see the module docstring)."""

    kind: ClassVar[TransportKind]

    # ---- learner half
    @abc.abstractmethod
    def prepare(self, version: int, state: Mapping[str, torch.Tensor], ctx: PublishContext) -> Prepared:
        """Pack `state` (a CPU snapshot in HF names) as `version`. Runs on the learner's model thread."""

    @abc.abstractmethod
    def write_descriptor(self, prepared: Prepared, message: types_pb2.WeightVersion) -> None:
        """Fill this transport's field of the `transport` oneof."""

    # ---- rollout half
    @abc.abstractmethod
    def read_descriptor(self, message: types_pb2.WeightVersion) -> Any:
        """This transport's field of the oneof as a frozen dataclass (InvalidArgument when malformed)."""

    @abc.abstractmethod
    async def stage(self, target: StageTarget, ctx: StageContext) -> Staged:
        """Fetch or attach the bytes of `target` and verify every bucket checksum; change nothing else."""

    # ---- engine half
    def open_tensors(
        self, spec: dict[str, Any], tensors: list[TensorEntry]
    ) -> AbstractContextManager[Iterator[tuple[str, torch.Tensor]]]:
        """(name, tensor) views of a staged version inside the loading process; valid inside the block."""
        raise NotImplementedError(f"{self.kind} hands over a plan of another kind; it is not a load medium")
