"""Deadlines that guard a transfer grow with the bytes it moves: a floor, plus the bytes at the
slowest rate we accept. A fixed deadline either kills a big model's honest load or lets a hung peer
hold a small model's run for minutes (prime-rl PR #3597: a 790B load took 72 minutes)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TransferDeadline(BaseModel):
    """`floor_s + bytes / (min_rate_mb_s · 1e6)` seconds for a transfer of `bytes`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    floor_s: float = Field(default=10.0, gt=0, description="Seconds any transfer may take, however small.")
    min_rate_mb_s: float = Field(
        default=20.0,
        gt=0,
        description="The slowest rate (MB/s) a healthy transfer keeps: each MB moved adds 1/rate seconds.",
    )

    def for_bytes(self, nbytes: int) -> float:
        """The deadline (seconds) of a transfer of `nbytes`."""
        return self.floor_s + max(nbytes, 0) / (self.min_rate_mb_s * 1e6)
