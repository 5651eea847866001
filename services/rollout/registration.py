"""A rollout that joins a scheduler by itself: `RegisterWorker` with the address the scheduler should
dial, at start and then every `interval_s`, so that a scheduler started after the rollout, or
restarted (its rollout list is in memory), learns of it again. What lets rollouts be a scaled set of
replicas (a Kubernetes Deployment) instead of a fixed address list in the scheduler's config.

Registration is idempotent on the scheduler (the same address is the same rollout), and a rollout
that goes away is forgotten there after `forget_unreachable_after`. A failed call is logged and
retried at the next interval; it never stops the rollout from serving.
"""

from __future__ import annotations

import asyncio
import socket

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.clients import GrpcClient
from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.rollout.config import RegistrationConfig

log = get_logger(__name__)


def advertised_address(config: RegistrationConfig, bound_port: int | None) -> str:
    """The host:port to register: `advertise_address`, else this host's name and the bound port."""
    if config.advertise_address:
        return config.advertise_address
    if bound_port is None:
        raise ValueError("registration needs the bound port or registration.advertise_address")
    return f"{socket.gethostname()}:{bound_port}"


class Registration:
    """Keeps one rollout registered with one scheduler until `stop()`."""

    def __init__(self, config: RegistrationConfig, address: str) -> None:
        self.config = config
        self.address = address
        self.registered = 0  # successful calls (tests and metrics read it)
        self._client = GrpcClient(config.scheduler_address, scheduler_pb2_grpc.SchedulerServiceStub)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._keep_registered(), name="register-with-scheduler")

    async def register_once(self) -> str:
        """One RegisterWorker call; returns the worker id the scheduler knows this rollout by."""
        request = scheduler_pb2.RegisterWorkerRequest(
            kind=scheduler_pb2.WORKER_KIND_ROLLOUT, address=self.address
        )
        response = await self._client.unary("RegisterWorker", request, timeout=self.config.timeout_s)
        self.registered += 1
        return response.worker_id

    async def _keep_registered(self) -> None:
        failing = False
        while True:
            try:
                worker_id = await self.register_once()
                if failing or self.registered == 1:
                    log.info("registered with the scheduler", scheduler=self.config.scheduler_address,
                             address=self.address, worker_id=worker_id)  # fmt: skip
                failing = False
            except GrpoError as exc:
                if not failing:  # once per outage, not every interval
                    log.warning("registering with the scheduler failed; retrying",
                                scheduler=self.config.scheduler_address, error=str(exc))  # fmt: skip
                failing = True
            await asyncio.sleep(self.config.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.close()
