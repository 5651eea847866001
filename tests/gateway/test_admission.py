"""The gateway in front of a training run: 429 + Retry-After while the run cannot take fresh work.

The scheduler here is a real gRPC server on 127.0.0.1:0 serving the scheduler's GetStatus contract
with a status the test sets (a whole run would make these states slow and racy to reach); the
rollouts and the gateway are the real ones.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.admission import RunView, staleness_full

from .support import gateway

CHAT = {"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 2, "temperature": 1.0}


class StatusServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self) -> None:
        self.status = scheduler_pb2.GetStatusResponse(learner_version=5)

    async def GetStatus(self, request, context):
        return self.status


def test_staleness_full_says_why() -> None:
    assert staleness_full(None, 1) == "the scheduler has not answered yet"
    assert staleness_full(RunView(5, (4,), False, False), 1) == ""
    assert "more than 1 versions behind learner v5" in staleness_full(RunView(5, (3, 2), False, False), 1)
    assert staleness_full(RunView(5, (5,), True, False), 1) == "the run is paused"
    assert staleness_full(RunView(5, (5,), False, True), 1) == "the run is finished"


@pytest.mark.asyncio(loop_scope="package")
async def test_429_while_the_runs_rollouts_are_too_stale_or_it_is_paused(rollouts) -> None:
    servicer = StatusServicer()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    addresses = [f"127.0.0.1:{r.port}" for r in rollouts]
    settings = {"scheduler": f"127.0.0.1:{port}", "max_staleness": 1, "poll_interval_s": 0.05}
    try:
        async with gateway(addresses, admission=settings) as (running, client):
            admission = running.app.gateway.admission

            async def status(**fields) -> None:
                servicer.status = scheduler_pb2.GetStatusResponse(**fields)
                await admission.poll_once()

            await status(learner_version=5, rollouts=[scheduler_pb2.RolloutLoad(weight_version=3)])
            refused = await client.post("/v1/chat/completions", json=CHAT)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert "admission" in refused.json()["error"]["message"]

            await status(learner_version=5, rollouts=[scheduler_pb2.RolloutLoad(weight_version=4)])
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200

            await status(
                learner_version=5, paused=True, rollouts=[scheduler_pb2.RolloutLoad(weight_version=5)]
            )
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 429

            await server.stop(None)  # a scheduler that stops answering closes admission
            await asyncio.wait_for(admission.poll_once(), 30)
            assert admission.reason == "the scheduler has not answered yet"
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 429
    finally:
        await server.stop(None)
