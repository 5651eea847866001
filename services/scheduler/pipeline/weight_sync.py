"""Two-phase weight sync and the logprob alignment probe (the scheduler coordinates; transports move bytes).

    learner.prepare(kind) → v         (its own copy of v: from here the learner may train on)
    every target rollout: stage(v)    (fetch/attach + verify checksums; nothing changes yet)
    every staged rollout: commit(v)   (pause, load, reset prefix cache, flip version, resume)
    learner.release(v)
    probe: learner.score_tokens (taken while it held v) vs each rollout's → max |Δ logprob|

`prepare` and `complete` are separate calls so that the scheduler can let the learner train its next
step while the rollouts stage, commit and answer the probe (`step_sync.py`).

A rollout that fails to stage or commit is dropped from this sync, so one dead or hung worker never
stalls training: each stage and commit has a deadline derived from the version's bytes
(`PreparedWeights.transfer_timeout`), and an unreachable one (down, or silent past that deadline) is
marked unhealthy, which also gives its groups in flight to the others (the health monitor brings it
back when it answers);
a reachable one is told to abort and waits for its next sync without work (`needs_sync`), which the
health monitor's next round retries. With a collective transport (nccl) one member's failure fails
the version for every member; the retry builds a new group of those still there.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from grpo.common.v1 import types_pb2
from services.common.errors import FailedPrecondition, GrpoError
from services.common.logging import get_logger
from services.scheduler.observe.timeline import SYNC, Timeline
from services.scheduler.peers.clients import LearnerClient, PreparedWeights, TokenScores
from services.scheduler.peers.rollouts import RolloutHandle, RolloutPool
from services.transports import Receiver, TransportKind

log = get_logger(__name__)


class AlignmentError(RuntimeError):
    """Learner and rollout disagree on logprobs after a sync: the run must not continue silently."""


@dataclass
class SyncResult:
    version: int
    synced: list[str]
    prepare_ms: float
    stage_ms: float
    commit_ms: float
    total_ms: float
    version_bytes: int = 0  # the version's payload (WeightVersion.total_bytes)
    moved_bytes: int = 0  # what reached the rollouts that staged it (per rollout: the payload, or its delta)

    def record(self) -> dict[str, float]:
        """The sync's phases and bytes as a step row's `sync_*` fields."""
        return {
            "sync_ms": self.total_ms,
            "sync_prepare_ms": self.prepare_ms,
            "sync_stage_ms": self.stage_ms,
            "sync_commit_ms": self.commit_ms,
            "sync_bytes": self.moved_bytes,
            "sync_version_bytes": self.version_bytes,
        }

    @classmethod
    def nothing(cls, version: int) -> SyncResult:
        """No rollout needed `version`: every healthy one holds it already."""
        return cls(version, [], 0.0, 0.0, 0.0, 0.0)


@dataclass
class PendingSync:
    """A version the learner has prepared for `targets`, not yet staged or committed."""

    targets: list[RolloutHandle]
    prepared: PreparedWeights
    started: float  # perf_counter at the start of prepare
    prepared_at: float


class WeightSyncer:
    def __init__(
        self,
        learner: LearnerClient,
        pool: RolloutPool,
        transport: TransportKind,
        timeline: Timeline | None = None,
    ) -> None:
        self._learner = learner
        self._pool = pool
        self._kind = transport
        self._timeline = timeline or Timeline()
        self.lock = asyncio.Lock()

    async def sync(self, targets: list[RolloutHandle]) -> SyncResult:
        """Move `targets` to the learner's current weights (two-phase). Caller holds `lock`."""
        return await self.complete(await self.prepare(targets))

    async def prepare(self, targets: list[RolloutHandle]) -> PendingSync:
        """The learner packs its current weights for `targets` (which take no new work until
        `complete`). Once this returns the learner may train on: a prepared version is its own copy
        (or, for a broadcast, pushed on the learner's model thread ahead of any later step)."""
        started = time.perf_counter()
        receivers = [Receiver(h.rollout_id, h.instance_id, h.weight_workers) for h in targets]
        prepared = await self._learner.prepare(self._kind, receivers, self._pool.holders())
        self._pool.begin_sync(targets)
        done = time.perf_counter()
        self._timeline.span(SYNC, "prepare", started, done, version=prepared.version, rollouts=len(targets))
        return PendingSync(targets, prepared, started, done)

    async def complete(self, pending: PendingSync) -> SyncResult:
        """Stage and commit a prepared version on its targets, then let the learner free it."""
        targets, prepared = pending.targets, pending.prepared
        try:
            # a rollout holding this version or a newer one has weights of a lineage the learner lost
            # when it restarted from an older checkpoint: it must go back (rewind)
            rewind = {h.address for h in targets if h.version >= prepared.version}
            received: dict[str, int] = {}  # address → bytes that reached it (deltas: fewer)

            async def stage(handle: RolloutHandle) -> None:
                received[handle.address] = await handle.client.stage(
                    prepared.message, prepared.transfer_timeout, rewind=handle.address in rewind
                )

            staged = await self._phase(targets, "stage", stage, prepared.version)
            after_stage = time.perf_counter()
            committed = await self._phase(
                staged,
                "commit",
                lambda h: h.client.commit(
                    prepared.version, rewind=h.address in rewind, deadline_s=prepared.transfer_timeout
                ),
                prepared.version,
            )
            self._pool.committed(committed, prepared.version)
            timeline, version = self._timeline, prepared.version
            timeline.span(
                SYNC, "stage", pending.prepared_at, after_stage, version=version, rollouts=len(staged)
            )
            timeline.span(
                SYNC, "commit", after_stage, time.perf_counter(), version=version, rollouts=len(committed)
            )
        finally:
            self._pool.end_sync(targets)
            await self._pool.notify()  # rollouts generate on the new version while the learner frees it
            await self._learner.release(prepared.version)
        done = time.perf_counter()
        return SyncResult(
            version=prepared.version,
            synced=[h.name for h in committed],
            prepare_ms=(pending.prepared_at - pending.started) * 1e3,
            stage_ms=(after_stage - pending.prepared_at) * 1e3,
            commit_ms=(done - after_stage) * 1e3,
            total_ms=(done - pending.started) * 1e3,
            version_bytes=prepared.message.total_bytes,
            moved_bytes=sum(received[h.address] for h in staged),
        )

    async def _phase(
        self,
        handles: list[RolloutHandle],
        phase: str,
        call: Callable[[RolloutHandle], Awaitable[object]],
        version: int,
    ) -> list[RolloutHandle]:
        """Run `call` on every handle at once; those that fail are dropped from the sync."""
        started = time.monotonic()
        results = await asyncio.gather(*(call(h) for h in handles), return_exceptions=True)
        ok = []
        for handle, result in zip(handles, results, strict=True):
            if isinstance(result, GrpoError):
                await self._drop(handle, version, phase, result, started)
            elif isinstance(result, BaseException):
                raise result
            else:
                ok.append(handle)
        return ok

    async def _drop(
        self, handle: RolloutHandle, version: int, phase: str, exc: GrpoError, started: float
    ) -> None:
        log.warning("weight sync failed on rollout", rollout=handle.name, phase=phase, error=str(exc))
        if exc.unreachable:
            await self._pool.lost_mid_sync(handle, started)
            return
        self._pool.hold_for_sync(handle)
        try:
            await handle.client.abort(version)
        except GrpoError as abort_exc:
            log.warning("abort failed", rollout=handle.name, error=str(abort_exc))
            if abort_exc.unreachable:
                await self._pool.mark(handle, healthy=False)

    async def score_learner(self, sequence: types_pb2.TokenSequence) -> TokenScores:
        """The learner's logprobs of the probe tokens, at its current version."""
        return await self._learner.score_tokens(sequence)

    async def probe(
        self,
        sequence: types_pb2.TokenSequence,
        rollouts: list[RolloutHandle],
        learner: TokenScores | None = None,
    ) -> list[float] | None:
        """Per probe token, the largest |learner − rollout| logprob across `rollouts` (inf where either
        side's logprob is NaN); None when no rollout answered (none held the version, or every one was
        unreachable): a skipped probe is not a pass.

        A rollout that cannot be reached is marked unhealthy and skipped (it is re-synced and probed
        when it comes back); a reachable one that disagrees raises AlignmentError. Without `learner`'s
        scores (`score_learner`, taken while the learner still held the rollouts' version) the learner
        scores with the rollouts, at once (one round trip, not one per rollout); answers are judged in
        `rollouts` order.
        """
        started = time.monotonic()
        rollout_scores = [handle.client.score_tokens(sequence) for handle in rollouts]
        if learner is None:
            first, *answers = await asyncio.gather(
                self.score_learner(sequence), *rollout_scores, return_exceptions=True
            )
            if isinstance(first, BaseException):
                raise first
            learner = first
        else:
            answers = await asyncio.gather(*rollout_scores, return_exceptions=True)
        worst: list[float] | None = None
        for handle, got in zip(rollouts, answers, strict=True):
            if isinstance(got, GrpoError) and got.unreachable:
                log.warning("probe skipped: rollout unreachable", rollout=handle.name, error=str(got))
                if self._pool.silent(started):  # (not when the scheduler itself stood still)
                    await self._pool.mark(handle, healthy=False)
                continue
            if isinstance(got, BaseException):
                raise got
            if got.weight_version != learner.weight_version:
                raise FailedPrecondition(
                    f"probe version mismatch: learner v{learner.weight_version}, "
                    f"{handle.name} v{got.weight_version}"
                )
            if len(got.logprobs) != len(learner.logprobs):
                raise AlignmentError(
                    f"{handle.name} scored {len(got.logprobs)} tokens, learner {len(learner.logprobs)}"
                )
            # a NaN logprob on either side is the worst disagreement, not one `max` may pass over
            pairs = zip(got.logprobs, learner.logprobs, strict=True)
            diffs = [math.inf if math.isnan(d := abs(a - b)) else d for a, b in pairs]
            worst = diffs if worst is None else [max(a, b) for a, b in zip(worst, diffs, strict=True)]
        return worst
