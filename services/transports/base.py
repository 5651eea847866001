"""The weight-transport contract: what every transport provides, on each side of a sync.

A weight version travels learner → rollout in three halves, all in one module per transport:

    learner half   prepare(version, state, ctx) → Prepared   pack into the medium (model thread);
                   Prepared.publish()                       then, still on the model thread, push it
                                                            (a broadcast; a no-op for pull transports)
                   write_descriptor(prepared, message)      how to reach it, into WeightVersion's oneof
    rollout half   read_descriptor(message) → descriptor    the same fields back, validated
                   await stage(target, ctx) → Staged        fetch/attach/receive + verify checksums
    engine half    worker_op(op, spec, worker)              runs in every process that holds the model
                                                            (each vLLM worker; the HF engine's process):
                                                            collective transports receive there
                   open_tensors(spec, tensors, worker)      (name, tensor) views where the engine loads

`Staged.plan` and every `worker_op` spec are plain data (a transport kind and a JSON-like spec)
because they cross vLLM's `collective_rpc` into worker processes: no pickle, no tensors, no dtype
objects. A transport that lands its bytes somewhere another transport can read (grpc_stream fetches
into a shared-memory segment) hands over a plan of that other kind, so engines have one load path
per medium.

The scheduler only coordinates: it passes the published message on, and reads one thing of a
descriptor, a collective transfer's own deadlines (nccl's `deadline_seconds`, through
`kinds.receive_bound_s`), to bound how long a rollout's stage may take. The byte layout, checksums and
manifest are common to all transports (`services/common/weights.py`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from grpo.common.v1 import types_pb2
from services.common.deadlines import TransferDeadline
from services.common.weights import Manifest, TensorEntry
from services.transports.kinds import Receiver, TransportKind


@dataclass(frozen=True)
class PublishContext:
    """What the learner half may need from the learner service (resolved lazily: only when used)."""

    run_id: str
    bucket_bytes: int
    chunk_bytes: int
    advertise_address: Callable[[], str]  # host:port of the learner; raises FailedPrecondition if unknown
    collective_timeout_s: float = 60.0
    collective_transfer: TransferDeadline | None = None  # the buckets' deadline (None: the default rate)
    collective_port: int = 0  # the rendezvous store's port; 0 = any free port
    delta: bool = True  # grpc_stream, nccl: sparse deltas against the last version packed (bf16/fp16)
    state: dict[str, Any] = field(default_factory=dict)  # per-learner state a transport keeps (groups)


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

    def publish(self) -> None:
        """Push the version to its receivers; runs on the learner's model thread right after the
        version is described to the caller, before any other model operation. Default: nothing (the
        rollouts pull)."""
        return None


@dataclass(frozen=True)
class WorkerContext:
    """One process that holds the model (a vLLM worker, or the transformers engine's process)."""

    state: dict[str, Any]  # per-worker state a transport keeps across versions (groups, buffers)
    local_rank: int  # index among the rollout's workers
    device: torch.device


class EngineWorkers(Protocol):
    """The rollout engine as the transports see it: run a transport operation in every worker."""

    async def call_workers(self, kind: str, op: str, spec: dict[str, Any]) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class StageContext:
    """What the rollout half may need from the rollout service."""

    rollout_id: str
    fetch_timeout_s: float
    workers: EngineWorkers | None = None


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
    # The views stay valid and unchanged until the next version is committed, so an engine whose dtype
    # and device match may adopt them as its parameters instead of copying (cuda_ipc).
    zero_copy: bool = False


class Staged(abc.ABC):
    """A fetched and verified version on the rollout, waiting for its commit."""

    def __init__(self, version: int, manifest: Manifest, fetch_ms: float) -> None:
        self.version = version
        self.manifest = manifest
        self.fetch_ms = fetch_ms
        self.received_bytes = manifest.total_bytes  # bytes that crossed the transport (less: deltas)

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
    # True: `prepare` gets the model's own tensors (no snapshot copy, on the model's device) and must
    # be done reading them when `publish` returns (a transport that packs in `prepare` is done then).
    # False: it gets a CPU snapshot it may keep.
    live_state: ClassVar[bool] = False

    # ---- learner half
    @abc.abstractmethod
    def prepare(
        self,
        version: int,
        state: Mapping[str, torch.Tensor],
        ctx: PublishContext,
        receivers: tuple[Receiver, ...] = (),
    ) -> Prepared:
        """Pack `state` (HF names) as `version`. Runs on the learner's model thread."""

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

    async def refuse(self, target: StageTarget, reason: str) -> None:  # noqa: B027 (an optional hook)
        """This member will not stage `target`: end a collective transfer of it for the whole group at
        once, so the learner and the others stop waiting (default: nothing, nobody waits)."""

    def close(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Free what the rollout half keeps between versions in this process (default: nothing)."""

    # ---- engine half
    def worker_op(self, op: str, spec: dict[str, Any], worker: WorkerContext) -> dict[str, Any]:
        """A transport operation inside one worker (plain data in and out). Default: none exist."""
        raise NotImplementedError(f"{self.kind} has no worker operation {op!r}")

    def open_tensors(
        self, spec: dict[str, Any], tensors: list[TensorEntry], worker: WorkerContext
    ) -> AbstractContextManager[Iterator[tuple[str, torch.Tensor]]]:
        """(name, tensor) views of a staged version inside the loading process; valid inside the block."""
        raise NotImplementedError(f"{self.kind} hands over a plan of another kind; it is not a load medium")
