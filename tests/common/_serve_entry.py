"""Test-only service process: the real serve skeleton (`run_service`) around a trivial app.

`tests/common/test_serve.py` runs `python tests/common/_serve_entry.py --port 0 --port-file F` to check
the process-level behaviour (port file, health, reflection via grpcurl, graceful SIGTERM → exit 0).
"""

from __future__ import annotations

import asyncio

import grpc
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.config import ServiceSettings
from services.common.serve import run_service


class EntrySettings(ServiceSettings):
    """Only the common fields."""

    config_table = "test_entry"
    model_config = SettingsConfigDict(env_prefix="GRPO_TEST_ENTRY__")

    hang_start: bool = Field(default=False, description="Make app.start() never return (signal handling).")


class _Servicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    async def GetStatus(self, request, context):
        return scheduler_pb2.GetStatusResponse(step=7)


class TrivialApp:
    """A SchedulerService that only answers GetStatus; nothing to start (unless told to hang) or stop."""

    service_names = (scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"].full_name,)

    def __init__(self, hang_start: bool = False) -> None:
        self.hang_start = hang_start

    def register(self, server: grpc.aio.Server) -> None:
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(_Servicer(), server)

    async def start(self) -> None:
        if self.hang_start:
            await asyncio.Event().wait()

    async def stop(self) -> None:
        return None


if __name__ == "__main__":
    settings = EntrySettings.from_cli(prog="_serve_entry.py")
    run_service("test-entry", lambda: TrivialApp(settings.hang_start), settings)
