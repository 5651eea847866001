"""Rollout service wiring: settings → RolloutApp → the shared server skeleton.

python -m services.rollout --port 50052 --model ./model --engine vllm --dtype float32
"""

from __future__ import annotations

import sys

import grpc

from grpo.rollout.v1 import rollout_pb2_grpc
from services.common.serve import run_service
from services.rollout.config import RolloutSettings
from services.rollout.rollout import Rollout

SERVICE_NAME = "grpo.rollout.v1.RolloutService"


class RolloutApp:
    """ServiceApp for a rollout worker. The engine is created in `start()`, inside the running loop."""

    service_names = (SERVICE_NAME,)

    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        self.rollout = Rollout(settings)

    def register(self, server: grpc.aio.Server) -> None:
        from services.rollout.servicer import RolloutServicer

        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(self.rollout), server)

    async def start(self) -> None:
        await self.rollout.start()

    async def stop(self) -> None:
        await self.rollout.stop()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    settings = RolloutSettings.from_cli(argv, prog="python -m services.rollout")
    run_service("rollout", lambda: RolloutApp(settings), settings)
