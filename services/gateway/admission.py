"""Admission: may one more generation request go out now? (backpressure, before any rollout is asked)

The gateway asks its `Admission` before every generating call and tells it when the call ended. A
refusal becomes 429 with `Retry-After` (the refusal's seconds), never a queue. The standalone
implementation bounds the requests in flight through the gateway; a scheduler that drives episodes
through the gateway plugs in one backed by its staleness bound (refuse while the policy lag is full,
as AReaL's proxy does), with the same two methods.
"""

from __future__ import annotations

from typing import Protocol


class Admission(Protocol):
    """Decides whether a generating request may start now. Called on the event loop: never blocks."""

    def try_admit(self, session_id: str) -> int | None:
        """None: admitted (the gateway calls `release` once when it ends). Otherwise the seconds a
        client should wait before retrying (the 429's Retry-After). `session_id` is "" without one."""

    def release(self, session_id: str) -> None:
        """The admitted request ended (answered, failed or cancelled)."""


class InFlightAdmission:
    """Standalone: at most `max_in_flight` generating requests through the gateway at once."""

    def __init__(self, max_in_flight: int, retry_after_s: int) -> None:
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    def try_admit(self, session_id: str) -> int | None:
        if self.in_flight >= self.max_in_flight:
            return self.retry_after_s
        self.in_flight += 1
        return None

    def release(self, session_id: str) -> None:
        self.in_flight -= 1
