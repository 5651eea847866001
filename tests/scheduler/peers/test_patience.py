"""`patiently`: a peer that does not answer (down, paused or frozen) is waited for, up to a limit."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from services.common.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from services.scheduler.peers.patience import PeerGone, patiently


@dataclass(frozen=True)
class Recovery:
    peer_restart_timeout: float = 5.0
    retry_interval: float = 0.01
    retry_max_interval: float = 0.04


class Peer:
    """Fails each call with the next error of `errors`, then answers."""

    def __init__(self, *errors: Exception, delay: float = 0.0) -> None:
        self.errors = list(errors)
        self.delay = delay
        self.calls: list[float] = []

    async def __call__(self) -> str:
        self.calls.append(time.monotonic())
        await asyncio.sleep(self.delay)
        if self.errors:
            raise self.errors.pop(0)
        return "answer"


async def test_a_call_that_timed_out_is_made_again_at_once() -> None:
    """A paused peer (SIGSTOP, GC pause) misses the deadline but answers the next call."""
    peer = Peer(DeadlineExceeded("env: deadline"), DeadlineExceeded("env: deadline"))
    assert await patiently(Recovery(retry_interval=10.0), "env", peer) == "answer"
    assert len(peer.calls) == 3
    assert peer.calls[-1] - peer.calls[0] < 5.0  # no 10 s back-off after a timeout


async def test_a_refused_call_backs_off_doubling_up_to_the_cap() -> None:
    peer = Peer(*(Unavailable("learner: connection refused") for _ in range(5)))
    assert await patiently(Recovery(), "learner", peer) == "answer"
    gaps = [b - a for a, b in zip(peer.calls, peer.calls[1:], strict=False)]
    assert len(gaps) == 5
    assert gaps[0] >= 0.01 and gaps[1] >= 0.02 and gaps[2] >= 0.04
    assert min(gaps[2:]) >= 0.04  # capped at retry_max_interval, never less


async def test_a_peer_silent_past_the_limit_ends_the_wait_naming_it_and_how_long() -> None:
    peer = Peer(*(DeadlineExceeded("env 127.0.0.1:1: DEADLINE_EXCEEDED") for _ in range(100)), delay=0.05)
    with pytest.raises(PeerGone) as caught:
        await patiently(Recovery(peer_restart_timeout=0.3), "env 127.0.0.1:1", peer)
    message = str(caught.value)
    assert message.startswith("env 127.0.0.1:1 did not answer for ")
    assert "peer_restart_timeout is 0.3 s" in message and "DeadlineExceeded" in message
    silent = float(message.split("did not answer for ")[1].split(" s")[0])
    assert silent >= 0.3
    assert caught.value.code == DeadlineExceeded.code  # the last error's status
    assert not caught.value.retryable


async def test_the_peers_own_answer_is_not_retried() -> None:
    peer = Peer(FailedPrecondition("learner: batch is for step 3"))
    with pytest.raises(FailedPrecondition):
        await patiently(Recovery(), "learner", peer)
    assert len(peer.calls) == 1


async def test_the_silence_is_counted_from_the_first_unanswered_call() -> None:
    """Three 0.1 s timeouts with a 0.25 s limit: the third attempt ends past it (0.3 s of silence)."""
    peer = Peer(*(DeadlineExceeded("x") for _ in range(3)), delay=0.1)
    with pytest.raises(PeerGone):
        await patiently(Recovery(peer_restart_timeout=0.25), "env", peer)
    assert len(peer.calls) == 3
