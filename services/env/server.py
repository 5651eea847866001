"""Environment service wiring: settings → EnvApp → the shared server skeleton.

python -m services.env --port 50051 --spec arithmetic --env-arg digits=3
python -m services.env check ENV_SPEC [--n 8] [--env-arg k=v ...]     (smoke test, see check.py)
"""

from __future__ import annotations

import sys

import grpc

from grpo.env.v1 import env_pb2_grpc
from services.common.serve import run_service
from services.env.config import EnvSettings
from services.env.loader import EnvLoadError, load_environment
from services.env.service import EnvService

SERVICE_NAME = "grpo.env.v1.EnvironmentService"


class EnvApp:
    """ServiceApp for the environment: registers the servicer, starts/stops the EnvService."""

    service_names = (SERVICE_NAME,)

    def __init__(self, settings: EnvSettings) -> None:
        self.settings = settings
        self.service = EnvService(settings)

    def register(self, server: grpc.aio.Server) -> None:
        from services.env.servicer import EnvironmentServicer

        env_pb2_grpc.add_EnvironmentServiceServicer_to_server(EnvironmentServicer(self.service), server)

    async def start(self) -> None:
        await self.service.start()

    async def stop(self) -> None:
        await self.service.stop()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "check":
        from services.env.check import main as check_main

        sys.exit(check_main(argv[1:]))
    settings = EnvSettings.from_cli(argv, prog="python -m services.env")
    try:  # fail fast, with the loader's message rather than a traceback, on a bad spec or options
        load_environment(settings.recipe())
    except EnvLoadError as exc:
        sys.exit(f"error: cannot load environment {settings.spec!r}:\n{exc}")
    run_service("env", lambda: EnvApp(settings), settings)
