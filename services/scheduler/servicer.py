"""SchedulerService: translates protos to calls on the app / orchestrator. No logic here."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import grpc

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from services.scheduler.app import SchedulerApp


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, app: SchedulerApp) -> None:
        self._app = app

    def _orchestrator(self):
        if self._app.orchestrator is None:
            raise FailedPrecondition("scheduler is still connecting to its peers")
        return self._app.orchestrator

    async def RegisterWorker(self, request, context: grpc.aio.ServicerContext):
        if request.kind != scheduler_pb2.WORKER_KIND_ROLLOUT:
            raise InvalidArgument(
                "only rollout workers can join a running scheduler (kind=WORKER_KIND_ROLLOUT)"
            )
        host, _, port = request.address.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"address must be host:port, got {request.address!r}")
        self._orchestrator()
        worker_id = self._app.add_rollout(request.address)
        return scheduler_pb2.RegisterWorkerResponse(worker_id=worker_id)

    async def GetStatus(self, request, context: grpc.aio.ServicerContext):
        orch = self._orchestrator()
        response = scheduler_pb2.GetStatusResponse(
            learner_version=orch.version,
            step=orch.step,
            paused=orch.paused,
            groups_by_state=orch.ledger.counts(),
            queue_depths={
                "prompts": orch.prompts.qsize(),
                "reissue": len(orch.reissue),
                "scored": orch.scored.qsize(),
            },
            staleness_mean=statistics.fmean(orch.staleness_seen) if orch.staleness_seen else 0.0,
            finished=orch.finished,
            max_steps=orch.settings.max_steps,
            logprob_abs_diff_max=orch.last_alignment,
            error=orch.error,
        )
        for h in orch.pool.handles():
            response.rollouts.add(
                rollout_id=h.rollout_id,
                address=h.address,
                weight_version=h.version,
                in_flight=h.in_flight,
                max_in_flight=h.max_in_flight,
                healthy=h.healthy,
            )
        return response

    async def Pause(self, request, context: grpc.aio.ServicerContext):
        self._orchestrator().pause(True)
        return scheduler_pb2.PauseResponse(paused=True)

    async def Resume(self, request, context: grpc.aio.ServicerContext):
        self._orchestrator().pause(False)
        return scheduler_pb2.ResumeResponse(paused=False)
