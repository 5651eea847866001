"""Gateway test helpers: a gateway on 127.0.0.1:0 over given rollouts, an in-memory call recorder."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from services.gateway.config import GatewaySettings
from services.gateway.recorder import CallRecord
from services.gateway.server import GatewayApp, RunningGateway
from services.rollout.config import RolloutSettings

MAX_MODEL_LEN = 256
TIMEOUT = 60.0


class ListRecorder:
    """A CallRecorder that keeps the records in memory (what the tests read back)."""

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []

    def record(self, call: CallRecord) -> None:
        self.calls.append(call)

    async def close(self) -> None:
        return None


def rollout_settings(model_dir: Path, rollout_id: str, **overrides) -> RolloutSettings:
    base = dict(
        model=str(model_dir), engine="transformers", port=0, max_model_len=MAX_MODEL_LEN,
        hf={"num_threads": 1}, rollout_id=rollout_id, max_in_flight=16,
    )  # fmt: skip
    return RolloutSettings.load(**{**base, **overrides})


@contextlib.asynccontextmanager
async def gateway(
    addresses: list[str], recorder: ListRecorder | None = None, admission_impl=None, **overrides
) -> AsyncIterator[tuple[RunningGateway, httpx.AsyncClient]]:
    """A gateway on 127.0.0.1:0 in front of `addresses` and an httpx client for it."""
    settings = GatewaySettings.load(rollouts=addresses, port=0, **overrides)
    running = RunningGateway(GatewayApp(settings, admission=admission_impl, recorder=recorder))
    await running.start()
    try:
        async with httpx.AsyncClient(base_url=running.url, timeout=TIMEOUT) as client:
            yield running, client
    finally:
        await running.stop()
