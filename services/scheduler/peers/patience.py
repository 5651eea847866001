"""Calling a peer that may be restarting: `patiently` retries while it is down, up to a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from services.common.errors import Unavailable
from services.common.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")


class Patience(Protocol):
    """How long to wait for a peer that went away (the scheduler's `RecoverySettings`)."""

    @property
    def peer_restart_timeout(self) -> float: ...

    @property
    def retry_interval(self) -> float: ...


async def patiently(cfg: Patience, peer: str, call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, retried while the peer is down (UNAVAILABLE: restarting), up to the restart timeout.
    A call that merely timed out is not retried here: a hung reward or step is not a restart."""
    deadline = time.monotonic() + cfg.peer_restart_timeout
    while True:
        try:
            return await call()
        except Unavailable as exc:
            if time.monotonic() > deadline:
                raise
            log.warning(f"{peer} unreachable; retrying", error=str(exc))
            await asyncio.sleep(cfg.retry_interval)
