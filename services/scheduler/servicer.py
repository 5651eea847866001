"""SchedulerService: translates protos to calls on the `Orchestrator` and its status back. No logic here."""

from __future__ import annotations

import math

import grpc

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common import validation as check
from services.common.errors import FailedPrecondition, InvalidArgument
from services.scheduler.orchestrator import Orchestrator
from services.scheduler.pipeline.intake import ACCEPTED, DUPLICATE, STALE

_VERDICTS = {
    ACCEPTED: scheduler_pb2.GROUP_VERDICT_ACCEPTED,
    DUPLICATE: scheduler_pb2.GROUP_VERDICT_DUPLICATE,
    STALE: scheduler_pb2.GROUP_VERDICT_STALE,
}


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self._orchestrator = orchestrator

    async def RegisterWorker(self, request, context: grpc.aio.ServicerContext):
        if request.kind != scheduler_pb2.WORKER_KIND_ROLLOUT:
            raise InvalidArgument(
                "only rollout workers can join a running scheduler (kind=WORKER_KIND_ROLLOUT)"
            )
        check.address(request.address)
        worker_id = self._orchestrator.register_rollout(request.address)
        return scheduler_pb2.RegisterWorkerResponse(worker_id=worker_id)

    async def GetStatus(self, request, context: grpc.aio.ServicerContext):
        s = self._orchestrator.status()
        return scheduler_pb2.GetStatusResponse(
            learner_version=s.learner_version,
            step=s.step,
            paused=s.paused,
            groups_by_state=s.groups_by_state,
            queue_depths=s.queue_depths,
            rollouts=[
                scheduler_pb2.RolloutLoad(
                    rollout_id=r.rollout_id,
                    address=r.address,
                    weight_version=r.weight_version,
                    in_flight=r.in_flight,
                    max_in_flight=r.max_in_flight,
                    healthy=r.healthy,
                )
                for r in s.rollouts
            ],
            staleness_mean=s.staleness_mean,
            finished=s.finished,
            max_steps=s.max_steps,
            logprob_abs_diff_max=None if math.isnan(s.logprob_abs_diff_max) else s.logprob_abs_diff_max,
            error=s.error,
            reward_mean=s.reward_mean,
            loss=s.loss,
            steps_per_second=s.steps_per_second,
            tokens_per_second=s.tokens_per_second,
            last_sync=scheduler_pb2.SyncPhases(
                prepare_ms=s.sync_ms[0], stage_ms=s.sync_ms[1], commit_ms=s.sync_ms[2], total_ms=s.sync_ms[3]
            ),
            weight_transport=s.weight_transport,
            uptime_seconds=s.uptime_seconds,
            source=s.source,
            queue_capacity=s.queue_capacity,
            group_size=s.group_size,
            groups_per_batch=s.groups_per_batch,
            level_success=s.level_success,
        )

    async def SubmitGroups(self, request, context: grpc.aio.ServicerContext):
        orchestrator = self._orchestrator
        if orchestrator.settings.source != "external":
            raise FailedPrecondition(
                "this scheduler trains its env service's prompts (source = env); start it with "
                "--source external to take SubmitGroups"
            )
        verdicts = await orchestrator.intake.submit(list(request.groups), request.source or "external")
        return scheduler_pb2.SubmitGroupsResponse(
            verdicts=[_VERDICTS[v.kind] for v in verdicts],
            reasons=[v.reason for v in verdicts],
            step=orchestrator.step,
            learner_version=orchestrator.version,
            waiting=orchestrator.intake.waiting,
            capacity=orchestrator.intake.capacity,
        )

    async def Pause(self, request, context: grpc.aio.ServicerContext):
        await self._orchestrator.set_paused(True)
        return scheduler_pb2.PauseResponse(paused=True)

    async def Resume(self, request, context: grpc.aio.ServicerContext):
        await self._orchestrator.set_paused(False)
        return scheduler_pb2.ResumeResponse(paused=False)
