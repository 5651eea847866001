"""The engine half of the `nccl` transport (see `nccl.py`): one receive per worker process.

Each worker that holds the model keeps a `_Receiver` in its transport state: its membership of the
current weight-sync group (the group's sealed store keys and its process group), its receive buffer
(kept across versions), what that buffer holds (the base of a delta broadcast, `nccl_delta.py`) and
the receipt of the last broadcast it was asked to receive. A receive runs
in its own thread: the roll call, a new group's connections, then every bucket, each wait bounded and
watching both the broadcast's abort key and the receipt's `why_stop` (set by `cancel`, or by the next
broadcast's `start`), so it always ends, releases the group, and lets the next version's receive in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.common import weight_delta, weights
from services.common.deadlines import TransferDeadline
from services.common.errors import DataLoss, FailedPrecondition
from services.transports import nccl_delta
from services.transports.base import WorkerContext
from services.transports.kinds import MESH_SLACK_S, transfer_deadline
from services.transports.process_group import (
    BroadcastAborted,
    SealedStore,
    abort,
    aborted,
    broadcast,
    close_group,
    connect_store,
    local_address,
    member_names,
    open_group,
    roll_call,
)

_PEER_LEFT = ("connection reset", "connection closed", "read error", "write error", "broken pipe")


def failure_kind(exc: BaseException) -> str:
    """How a receive failed, as the rollout reports it: `aborted` (a member ended the broadcast or
    left it mid-way: this worker is sound, retry with the next version), `deadline` (a wait ran out),
    `unavailable` (anything else, e.g. the learner's store cannot be reached)."""
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, DataLoss):
        return "data_loss"
    if isinstance(exc, BroadcastAborted) or any(sign in text for sign in _PEER_LEFT):
        return "aborted"
    if isinstance(exc, TimeoutError | dist.DistStoreError) or "timeout" in text or "timed out" in text:
        return "deadline"
    return "unavailable"


def op_timeout_s(deadline_s: float, transfer: TransferDeadline, bucket_bytes: int) -> float:
    """A group's own collective timeout: the backstop behind our deadlines (how long an abandoned
    collective may linger), and its connections' timeout."""
    return max(deadline_s, transfer.for_bytes(bucket_bytes))


@dataclass
class Receipt:
    version: int
    broadcast_id: str
    status: str = "receiving"  # receiving | done | failed
    kind: str = ""  # failure kind: deadline | data_loss | aborted | unavailable
    error: str = ""
    received: int = 0  # bytes that crossed the group (less than the version's for deltas)
    why_stop: str = ""  # set to end the receive (cancelled, or superseded by the next version's)

    def stop(self) -> str:
        return self.why_stop


class NcclWorker:
    """One worker's side: its group membership, receive buffer and the receipt of the last version."""

    def __init__(self) -> None:
        self.group_id = ""
        self.handle: dist.ProcessGroup | None = None
        self.store: SealedStore | None = None  # the group's keys
        self.buffer: torch.Tensor | None = None
        self.holds = ""  # nccl_delta.holding of the verified version in `buffer` ("": unknown)
        self.scratch: torch.Tensor | None = None  # receives delta payloads (kept across versions)
        self.receipt: Receipt | None = None
        self.superseded: Receipt | None = None  # the one before, so its stage learns why it ended
        self.thread: threading.Thread | None = None
        self.loading = False
        self.lock = threading.Lock()

    def start(self, spec: dict[str, Any], worker: WorkerContext) -> dict[str, Any]:
        """Start receiving `spec`'s broadcast; a receive still running (an older broadcast's) is told to
        stop, and the new one begins once it has (within `MESH_SLACK_S`)."""
        with self.lock:
            receipt = self.receipt
            if (
                receipt is not None
                and receipt.broadcast_id == spec["broadcast_id"]
                and receipt.status != "failed"
            ):
                return {"started": False}  # a retried StageWeights: the same receipt answers polls
            if self.loading:
                raise FailedPrecondition("a weight load from the receive buffer is in progress")
            previous = self.thread if self.thread is not None and self.thread.is_alive() else None
            if previous is not None and receipt is not None:
                receipt.why_stop = f"superseded by weight version {spec['version']}'s broadcast"
            self.superseded = receipt
            self.receipt = Receipt(spec["version"], spec["broadcast_id"])
            self.thread = threading.Thread(
                target=self._receive, args=(spec, worker, self.receipt, previous), name="grpo-nccl-receive",
                daemon=True,
            )  # fmt: skip
            self.thread.start()
        return {"started": True}

    def cancel(self, broadcast_id: str, why: str) -> dict[str, Any]:
        """Stop receiving `broadcast_id` (the rollout gave up on it); ends within a slice."""
        receipt = self.receipt
        if receipt is not None and receipt.broadcast_id == broadcast_id and receipt.status == "receiving":
            receipt.why_stop = why or "cancelled"
        return {"cancelled": receipt is not None and receipt.broadcast_id == broadcast_id}

    def poll(self, version: int, broadcast_id: str) -> dict[str, Any]:
        receipt = next(
            (r for r in (self.receipt, self.superseded) if r is not None and r.broadcast_id == broadcast_id),
            None,
        )
        if receipt is None:
            return {
                "status": "failed",
                "kind": "unavailable",
                "error": f"version {version} is not being received",
            }
        return {
            "status": receipt.status,
            "kind": receipt.kind,
            "error": receipt.error,
            "received": receipt.received,
        }

    def _drop_group(self) -> None:
        close_group(self.handle)  # a failed collective leaves the group unusable
        self.handle, self.group_id = None, ""

    def _receive(
        self,
        spec: dict[str, Any],
        worker: WorkerContext,
        receipt: Receipt,
        previous: threading.Thread | None,
    ) -> None:
        join_s = float(spec["deadline_seconds"])
        transfer = transfer_deadline(float(spec["transfer_floor_s"]), float(spec["transfer_min_rate_mb_s"]))
        rank, world = int(spec["first_rank"]) + worker.local_rank, int(spec["world_size"])
        names = member_names(spec["ranks"], world)
        device = worker.device if spec["backend"] == "nccl" else torch.device("cpu")
        keys: SealedStore | None = None
        try:
            if previous is not None:
                previous.join(MESH_SLACK_S)
            master, port = spec["master_address"], int(spec["master_port"])
            if previous is not None and previous.is_alive():
                keys = connect_store(master, port, spec["secret"], spec["group_id"], join_s)
                keys = keys.child(f"b/{spec['broadcast_id']}")
                raise TimeoutError(f"the previous receive did not end within {MESH_SLACK_S:g}s")
            if self.store is None or self.group_id != spec["group_id"]:
                self._drop_group()
                self.store = connect_store(master, port, spec["secret"], spec["group_id"], join_s)
                self.group_id = spec["group_id"]
            keys = self.store.child(f"b/{spec['broadcast_id']}")
            manifest = weights.manifest_from_plain(spec)
            total = manifest.total_bytes
            fits = self.buffer is not None and self.buffer.numel() >= total and self.buffer.device == device
            nccl_delta.say_holding(keys, rank, self.holds if fits else "")
            verdict = roll_call(keys, spec["group_id"], rank, world, join_s, names, receipt.stop).split()

            def stop() -> str:
                return receipt.why_stop or aborted(keys)

            if b"mesh" in verdict or self.handle is None:
                if b"mesh" not in verdict:  # the group is kept, but we lost our connections to it
                    raise BroadcastAborted(f"{names.get(rank)} lost its connection to group {self.group_id}")
                close_group(self.handle)
                op_timeout = op_timeout_s(join_s, transfer, max(b.nbytes for b in manifest.buckets))
                self.handle = open_group(
                    spec["backend"], self.store, rank, world, op_timeout, local_address(master, port), stop,
                    spec["group_id"],
                )  # fmt: skip
            if not fits:
                self.buffer = torch.empty(total, dtype=torch.uint8, device=device)  # kept across versions
            self.holds = ""  # the buffer is being overwritten: it holds a version again once verified
            deltas = nccl_delta.from_plain(spec.get("bucket_deltas")) if b"delta" in verdict else ()
            if b"delta" in verdict and len(deltas) != len(manifest.buckets):
                raise DataLoss(
                    f"a delta broadcast of {len(manifest.buckets)} buckets lists {len(deltas)} deltas"
                )
            until = time.monotonic() + transfer.for_bytes(total)
            for bucket, delta in zip(
                manifest.buckets, deltas or (None,) * len(manifest.buckets), strict=True
            ):
                target = self.buffer[bucket.offset : bucket.offset + bucket.nbytes]
                receipt.received += self._receive_bucket(target, delta, until, stop, device)
            try:
                weights.verify_buckets(self.buffer, manifest)
            except DataLoss as exc:
                receipt.kind, receipt.error, receipt.status = "data_loss", str(exc), "failed"
                return
            self.holds = nccl_delta.holding(int(spec["version"]), weight_delta.base_digest(manifest))
            receipt.status = "done"
        except Exception as exc:
            if previous is None or not previous.is_alive():  # else the group is still the previous one's
                self._drop_group()
                self.store = None
            text = f"{type(exc).__name__}: {exc}"
            me = f"{names.get(rank, '?')} (rank {rank}) of group {spec['group_id']}"
            if keys is not None:
                abort(keys, f"{me}: {text}")  # everyone else stops at once (unless someone else did)
            receipt.kind = failure_kind(exc)
            receipt.error = f"{me}: {text}"[:2000]
            receipt.status = "failed"

    def _receive_bucket(
        self,
        target: torch.Tensor,
        delta: nccl_delta.BucketDelta | None,
        until: float,
        stop: Callable[[], str],
        device: torch.device,
    ) -> int:
        """One bucket into `target` (its bytes in the receive buffer): whole, or a delta's payload
        rebuilt over the base there. Returns the bytes received."""
        assert self.handle is not None
        if delta is None or delta.encoding is weight_delta.Encoding.FULL:
            broadcast(self.handle, target, until, stop)
            return target.numel()
        size = delta.payload_bytes
        if self.scratch is None or self.scratch.numel() < size or self.scratch.device != device:
            self.scratch = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
        payload = self.scratch[:size]
        if size:
            broadcast(self.handle, payload, until, stop)
        weight_delta.apply_tensor(target, delta.encoding, payload)
        return size

    @contextmanager
    def open(
        self, spec: dict[str, Any], tensors: list[weights.TensorEntry]
    ) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        receipt = self.receipt
        if (
            receipt is None
            or receipt.broadcast_id != spec["broadcast_id"]
            or receipt.status != "done"
            or self.buffer is None
        ):
            raise FailedPrecondition(f"weight version {spec['version']} was not received by this worker")
        self.loading = True
        try:
            yield weights.tensor_views(self.buffer, tensors)
        finally:
            self.loading = False
