"""Scheduler wiring: settings → gRPC clients of the three peers → `Orchestrator` → the server skeleton.

    python -m services.scheduler --port 50050 --env-address HOST:PORT --learner-address HOST:PORT \
        --rollout-addresses '["HOST:PORT"]' --max-steps 100
"""

from __future__ import annotations

import asyncio
from functools import partial

import grpc

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.logging import get_logger
from services.common.serve import run_service, service_names
from services.common.telemetry import Reading
from services.scheduler.config import SchedulerSettings
from services.scheduler.orchestrator import Orchestrator
from services.scheduler.peers.grpc_clients import GrpcEnvClient, GrpcLearnerClient, GrpcRolloutClient
from services.scheduler.peers.rollouts import RolloutPool
from services.scheduler.servicer import SchedulerServicer

log = get_logger(__name__)


class SchedulerApp:
    """ServiceApp adapter: connects the peers, runs the orchestrator in the background.

    A failed run is recorded in `orchestrator.error` (GetStatus reports it) and the server keeps
    serving, so operators can still inspect what happened.
    """

    service_names = service_names(scheduler_pb2)

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        timeouts = settings.timeouts
        # source = external: no env service (groups come from SubmitGroups)
        self.env = GrpcEnvClient(settings.env_address, timeouts) if settings.source == "env" else None
        self.learner = GrpcLearnerClient(settings.learner_address, timeouts)
        self.pool = RolloutPool(
            partial(GrpcRolloutClient, timeouts=timeouts, generate_batch=settings.generate_batch),
            max_rollouts=settings.max_rollouts,
            forget_after=settings.forget_unreachable_after,
        )
        for address in settings.rollout_addresses:
            self.pool.add(address)
        self.orchestrator = Orchestrator(settings, self.env, self.learner, self.pool)
        self.run_task: asyncio.Task | None = None
        self.bound_port: int | None = None

    def register(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(
            SchedulerServicer(self.orchestrator), server
        )

    async def start(self) -> None:
        connect = self.settings.timeouts.connect
        peers = [*([self.env] if self.env else []), self.learner, *(h.client for h in self.pool.handles())]
        await asyncio.gather(*(peer.wait_ready(connect) for peer in peers))
        if self.settings.autostart:
            self.run_task = asyncio.create_task(self._run(), name="orchestrator")

    async def _run(self) -> None:
        try:
            await self.orchestrator.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # recorded in orchestrator.error and reported by GetStatus
            log.error("training run stopped", error=self.orchestrator.error)

    async def stop(self) -> None:
        if self.run_task is not None:
            self.run_task.cancel()
            await asyncio.gather(self.run_task, return_exceptions=True)
        env = [self.env.close()] if self.env else []
        await asyncio.gather(self.pool.close(), self.learner.close(), *env)

    def metrics_snapshot(self) -> list[Reading]:
        """Prometheus view (telemetry.py), from the same status GetStatus reports."""
        s = self.orchestrator.status()
        readings = [
            Reading("grpo_scheduler_step", "Optimizer steps done.", s.step),
            Reading("grpo_scheduler_learner_version", "The learner's weight version.", s.learner_version),
            Reading("grpo_scheduler_paused", "1 while paused.", float(s.paused)),
            Reading("grpo_scheduler_reward_mean", "Mean reward of the last step's batch.", s.reward_mean),
            Reading("grpo_scheduler_loss", "The learner's loss at the last step.", s.loss),
            Reading("grpo_scheduler_steps_per_second", "Steps per second over the last minute.",
                    s.steps_per_second),
            Reading("grpo_scheduler_tokens_per_second", "Completion tokens per second (last step).",
                    s.tokens_per_second),
            Reading("grpo_scheduler_logprob_abs_diff_max",
                    "Max |learner - rollout| logprob at the last alignment probe.", s.logprob_abs_diff_max),
            Reading("grpo_scheduler_staleness_mean", "Mean staleness of the groups trained so far.",
                    s.staleness_mean),
        ]  # fmt: skip
        readings += [
            Reading("grpo_scheduler_queue_depth", "Queue depth, by queue.", depth, {"queue": queue})
            for queue, depth in s.queue_depths.items()
        ]
        readings += [
            Reading(
                "grpo_scheduler_groups",
                "Groups by lifecycle state (issued = in flight).",
                n,
                {"state": state},
            )
            for state, n in s.groups_by_state.items()
        ]
        for r in s.rollouts:
            labels = {"rollout": r.rollout_id or r.address}
            readings += [
                Reading("grpo_scheduler_rollout_healthy", "1 when the rollout answers and is ready.",
                        float(r.healthy), labels),
                Reading("grpo_scheduler_rollout_version", "Weight version each rollout serves.",
                        r.weight_version, labels),
                Reading("grpo_scheduler_rollout_in_flight", "Groups in flight on each rollout.",
                        r.in_flight, labels),
            ]  # fmt: skip
        return readings


def main(argv: list[str] | None = None, prog: str = "python -m services.scheduler") -> None:
    settings = SchedulerSettings.from_cli(argv, prog=prog)
    run_service("scheduler", lambda: SchedulerApp(settings), settings)
