"""Calling a peer that may be restarting, paused or frozen: `patiently` waits for it, up to a deadline.

Hung is not dead. A peer that does not answer, whether it is down (UNAVAILABLE: a supervisor is
restarting it) or alive but not answering in time (DEADLINE_EXCEEDED: a GC pause, a swap storm, a
debugger, a SIGSTOP, a preempted container, a stuck NFS read), is waited for the same way: the call
is made again, up to `peer_restart_timeout` seconds after the peer first failed to answer. A call
that timed out is made again at once (it has waited its deadline already; a paused process answers
the queued call as soon as it runs again); a refused one after a back-off that doubles from
`retry_interval` up to `retry_max_interval`. Only a peer gone for longer than that ends the run, with
a message that names it and says for how long.

Only calls that are safe to repeat go through here (docs/recovery.md lists them): reads, pure
functions of their request, and calls the peer deduplicates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from services.common.errors import DeadlineExceeded, GrpoError
from services.common.logging import get_logger

log = get_logger(__name__)
T = TypeVar("T")


class Patience(Protocol):
    """How long to wait for a peer that stopped answering (the scheduler's `RecoverySettings`)."""

    @property
    def peer_restart_timeout(self) -> float: ...

    @property
    def retry_interval(self) -> float: ...

    @property
    def retry_max_interval(self) -> float: ...


class PeerGone(GrpoError):
    """A peer did not answer for longer than the recovery timeout: the run cannot go on without it."""

    retryable = False
    unreachable = True

    def __init__(self, peer: str, silent_s: float, limit_s: float, last: GrpoError) -> None:
        self.code = last.code
        super().__init__(
            f"{peer} did not answer for {silent_s:.1f} s (recovery.peer_restart_timeout is {limit_s:g} s); "
            f"last error: {type(last).__name__}: {last}"
        )


async def patiently(cfg: Patience, peer: str, call: Callable[[], Awaitable[T]]) -> T:
    """`call()`, made again while `peer` does not answer (down, paused or frozen), up to
    `cfg.peer_restart_timeout` seconds after it first failed to; `PeerGone` after that. Errors that are
    the peer's answer (a refusal, a bad request) are raised at once."""
    silent_since: float | None = None
    backoff = cfg.retry_interval
    while True:
        started = time.monotonic()
        try:
            result = await call()
        except GrpoError as exc:
            if not exc.unreachable or isinstance(exc, PeerGone):
                raise
            now = time.monotonic()
            if silent_since is None:
                silent_since = started  # the peer has not answered since this attempt went out
            silent_s = now - silent_since
            if silent_s >= cfg.peer_restart_timeout:
                raise PeerGone(peer, silent_s, cfg.peer_restart_timeout, exc) from exc
            state = "not answering in time (slow or paused)" if isinstance(exc, DeadlineExceeded) else "down"
            log.warning(
                f"{peer} {state}; waiting for it",
                silent_s=round(silent_s, 1),
                gives_up_after_s=cfg.peer_restart_timeout,
                error=str(exc),
            )
            if not isinstance(exc, DeadlineExceeded):  # a timed-out call has waited already
                await asyncio.sleep(min(backoff, cfg.peer_restart_timeout - silent_s))
                backoff = min(backoff * 2, cfg.retry_max_interval)
            continue
        if silent_since is not None:
            log.info(f"{peer} answers again", silent_s=round(time.monotonic() - silent_since, 1))
        return result
