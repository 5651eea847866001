"""Environment service entry point: settings → EnvApp (EnvHost + servicer) → the shared server skeleton.

    python -m services.env --port 50051 --spec arithmetic --env-arg digits=3     (= grpo-mesh serve env)

Smoke-testing an environment before training is `grpo-mesh check-env ENV_SPEC` (check.py).
"""

from __future__ import annotations

import sys

import grpc

from grpo.env.v1 import env_pb2, env_pb2_grpc
from services.common.serve import run_service, service_names
from services.common.telemetry import Reading
from services.env.config import EnvSettings
from services.env.host import EnvHost
from services.env.loader import EnvLoadError, load_recipe
from services.env.servicer import EnvironmentServicer


class EnvApp:
    """ServiceApp for the environment: registers the servicer, starts/stops the EnvHost."""

    service_names = service_names(env_pb2)

    def __init__(self, settings: EnvSettings) -> None:
        self.settings = settings
        self.host = EnvHost(settings)
        self.bound_port: int | None = None

    def register(self, server: grpc.aio.Server) -> None:
        env_pb2_grpc.add_EnvironmentServiceServicer_to_server(EnvironmentServicer(self.host), server)

    async def start(self) -> None:
        await self.host.start()

    async def stop(self) -> None:
        await self.host.stop()

    def metrics_snapshot(self) -> list[Reading]:
        """Prometheus view (telemetry.py): the host's counters, split positions and scoring workers."""
        if not self.host.ready:
            return []
        readings = [
            Reading("grpo_env_events", "Environment events (prompts sampled, groups scored, failures "
                    "by kind, worker restarts), by event.", value, {"event": key.removeprefix("env/")},
                    counter=True)
            for key, value in self.host.metrics().items()
        ]  # fmt: skip
        readings += [
            Reading(
                "grpo_env_position", "Prompt cursor position, by split.", float(position), {"split": split}
            )
            for split, position in self.host.positions().items()
        ]
        readings.append(
            Reading("grpo_env_score_workers", "Scoring worker processes running.", self.host.workers())
        )
        return readings


def main(argv: list[str] | None = None, prog: str = "python -m services.env") -> None:
    settings = EnvSettings.from_cli(argv, prog=prog)
    try:  # fail fast, with the loader's message rather than a traceback, on a bad spec or options
        load_recipe(settings.recipe())
    except EnvLoadError as exc:
        sys.exit(f"error: cannot load environment {settings.spec!r}:\n{exc}")
    run_service("env", lambda: EnvApp(settings), settings)
