"""The scheduler's ServiceApp: connects to its peers and runs the orchestrator in the background."""

from __future__ import annotations

import asyncio

import grpc

from grpo.env.v1 import env_pb2_grpc
from grpo.learner.v1 import learner_pb2_grpc
from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.clients import open_channel, wait_ready
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.orchestrator import Orchestrator
from services.scheduler.rollouts import RolloutPool
from services.scheduler.servicer import SchedulerServicer

log = get_logger(__name__)


class SchedulerApp:
    service_names = (scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name,)

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.orchestrator: Orchestrator | None = None
        self.run_task: asyncio.Task | None = None
        self._channels: list[grpc.aio.Channel] = []
        self._pool: RolloutPool | None = None

    def register(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(SchedulerServicer(self), server)

    async def start(self) -> None:
        cfg = self.settings
        env_channel, learner_channel = open_channel(cfg.env_address), open_channel(cfg.learner_address)
        self._channels = [env_channel, learner_channel]
        self._pool = RolloutPool(cfg.timeouts.control)
        for address in cfg.rollout_addresses:
            self._pool.add(address)
        await asyncio.gather(
            *(
                wait_ready(ch, cfg.timeouts.connect)
                for ch in [*self._channels, *(h.channel for h in self._pool.handles())]
            )
        )
        self.orchestrator = Orchestrator(
            cfg,
            env_pb2_grpc.EnvironmentServiceStub(env_channel),
            learner_pb2_grpc.LearnerServiceStub(learner_channel),
            self._pool,
        )
        if cfg.autostart:
            self.start_run()

    def start_run(self) -> None:
        assert self.orchestrator is not None
        self.run_task = asyncio.create_task(self._run(), name="orchestrator")

    async def _run(self) -> None:
        assert self.orchestrator is not None
        try:
            await self.orchestrator.run()
        except asyncio.CancelledError:
            raise
        except (
            Exception
        ):  # recorded in orchestrator.error and reported by GetStatus; the server keeps serving
            log.error("training run stopped", error=self.orchestrator.error)

    def add_rollout(self, address: str) -> str:
        assert self._pool is not None
        return self._pool.add(address).address

    async def stop(self) -> None:
        if self.run_task is not None:
            self.run_task.cancel()
            await asyncio.gather(self.run_task, return_exceptions=True)
        if self._pool is not None:
            await self._pool.close()
        await asyncio.gather(*(ch.close() for ch in self._channels))
