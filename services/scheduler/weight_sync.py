"""Two-phase weight sync and the logprob alignment probe.

    learner.PrepareWeights(kind) → v
    every target rollout: StageWeights(v)   (fetch + verify checksums; nothing changes yet)
    every staged rollout: CommitWeights(v)  (pause, load, reset prefix cache, flip version, resume)
    probe: learner.ScoreTokens vs rollout.ScoreTokens on a fixed sequence → max |Δ logprob|
    learner.ReleaseWeights(v)

A rollout that fails to stage is aborted and marked unhealthy (the health monitor brings it back and
it catches up later); the others still move to v, so one dead worker never stalls training.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from grpo.rollout.v1 import rollout_pb2
from services.common.errors import FailedPrecondition
from services.common.logging import get_logger
from services.scheduler.config import TimeoutSettings
from services.scheduler.rollouts import RolloutHandle, RolloutPool

log = get_logger(__name__)

TRANSPORTS = {
    "grpc_stream": types_pb2.WEIGHT_TRANSPORT_KIND_GRPC_STREAM,
    "shared_memory": types_pb2.WEIGHT_TRANSPORT_KIND_SHARED_MEMORY,
}


_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


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


class WeightSyncer:
    def __init__(
        self,
        learner: learner_pb2_grpc.LearnerServiceStub,
        pool: RolloutPool,
        transport: str,
        timeouts: TimeoutSettings,
    ) -> None:
        self._learner = learner
        self._pool = pool
        self._kind = TRANSPORTS[transport]
        self._timeouts = timeouts
        self.lock = asyncio.Lock()

    async def sync(self, targets: list[RolloutHandle]) -> SyncResult:
        """Move `targets` to the learner's current weights (two-phase). Caller holds `lock`."""
        started = time.perf_counter()
        prepared = await self._learner.PrepareWeights(
            learner_pb2.PrepareWeightsRequest(transport=self._kind), timeout=self._timeouts.weight_sync
        )
        version = prepared.weight_version.version
        after_prepare = time.perf_counter()
        for handle in targets:
            handle.syncing = True
        try:
            staged = await self._stage_all(targets, prepared.weight_version)
            after_stage = time.perf_counter()
            committed = await self._commit_all(staged, version)
        finally:
            for handle in targets:
                handle.syncing = False
            await self._learner.ReleaseWeights(
                learner_pb2.ReleaseWeightsRequest(version=version), timeout=self._timeouts.control
            )
            await self._pool.notify()
        done = time.perf_counter()
        return SyncResult(
            version=version,
            synced=[h.rollout_id for h in committed],
            prepare_ms=(after_prepare - started) * 1e3,
            stage_ms=(after_stage - after_prepare) * 1e3,
            commit_ms=(done - after_stage) * 1e3,
            total_ms=(done - started) * 1e3,
        )

    async def _stage_all(
        self, targets: list[RolloutHandle], wv: types_pb2.WeightVersion
    ) -> list[RolloutHandle]:
        request = rollout_pb2.StageWeightsRequest(weight_version=wv)
        results = await asyncio.gather(
            *(h.stub.StageWeights(request, timeout=self._timeouts.weight_sync) for h in targets),
            return_exceptions=True,
        )
        staged = []
        for handle, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                await self._drop(handle, wv.version, "stage", result)
            else:
                staged.append(handle)
        return staged

    async def _commit_all(self, staged: list[RolloutHandle], version: int) -> list[RolloutHandle]:
        request = rollout_pb2.CommitWeightsRequest(version=version)
        results = await asyncio.gather(
            *(h.stub.CommitWeights(request, timeout=self._timeouts.weight_sync) for h in staged),
            return_exceptions=True,
        )
        committed = []
        for handle, result in zip(staged, results, strict=True):
            if isinstance(result, BaseException):
                await self._drop(handle, version, "commit", result)
            else:
                handle.version = result.version
                committed.append(handle)
        return committed

    async def _drop(self, handle: RolloutHandle, version: int, phase: str, exc: BaseException) -> None:
        if not isinstance(exc, grpc.aio.AioRpcError):
            raise exc
        log.warning(
            "weight sync failed on rollout",
            rollout=handle.rollout_id,
            phase=phase,
            code=exc.code().name,
            detail=exc.details(),
        )
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            try:
                await handle.stub.AbortWeights(
                    rollout_pb2.AbortWeightsRequest(version=version), timeout=self._timeouts.control
                )
            except grpc.aio.AioRpcError as abort_exc:
                log.warning("abort failed", rollout=handle.rollout_id, code=abort_exc.code().name)
        await self._pool.mark(handle, healthy=False)

    async def probe(self, sequence: types_pb2.TokenSequence, rollouts: list[RolloutHandle]) -> float:
        """Max |learner − rollout| logprob over the probe tokens, across `rollouts`.

        A rollout that cannot be reached is marked unhealthy and skipped (it is re-synced and probed
        when it comes back); a reachable one that disagrees raises AlignmentError.
        """
        learner = await self._learner.ScoreTokens(
            learner_pb2.ScoreTokensRequest(sequence=sequence), timeout=self._timeouts.control
        )
        worst = 0.0
        for handle in rollouts:
            try:
                got = await handle.stub.ScoreTokens(
                    rollout_pb2.ScoreTokensRequest(sequence=sequence), timeout=self._timeouts.control
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _UNREACHABLE:
                    raise
                log.warning(
                    "probe skipped: rollout unreachable", rollout=handle.rollout_id, code=exc.code().name
                )
                await self._pool.mark(handle, healthy=False)
                continue
            if got.weight_version != learner.weight_version:
                raise FailedPrecondition(
                    f"probe version mismatch: learner v{learner.weight_version}, "
                    f"{handle.rollout_id} v{got.weight_version}"
                )
            if len(got.logprobs) != len(learner.logprobs):
                raise AlignmentError(
                    f"{handle.rollout_id} scored {len(got.logprobs)} tokens, learner {len(learner.logprobs)}"
                )
            diff = max((abs(a - b) for a, b in zip(got.logprobs, learner.logprobs, strict=True)), default=0.0)
            worst = max(worst, diff)
        return worst
