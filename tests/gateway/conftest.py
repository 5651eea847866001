"""Gateway fixtures: real rollout servers (transformers engine, the tiny model) on 127.0.0.1:0, shared
by the package's tests in one package-scoped event loop (the gateways start per module or test)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from gateway.support import rollout_settings
from services.common.serve import RunningServer, start_server
from services.rollout.server import RolloutApp


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def rollouts(tiny_model_dir: Path) -> AsyncIterator[list[RunningServer]]:
    """Two rollout workers (ids "r0" and "r1")."""
    servers = []
    try:
        for name in ("r0", "r1"):
            settings = rollout_settings(tiny_model_dir, name)
            servers.append(await start_server(RolloutApp(settings), settings))
        yield servers
    finally:
        for server in servers:
            await server.close()
