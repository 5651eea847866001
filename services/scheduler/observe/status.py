"""What the scheduler reports about a run (GetStatus): plain values, built by the orchestrator."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RolloutStatus:
    rollout_id: str
    address: str
    weight_version: int
    in_flight: int
    max_in_flight: int
    healthy: bool


@dataclass(frozen=True)
class SchedulerStatus:
    """What GetStatus reports: versions, progress, queues, rollouts, alignment and errors."""

    learner_version: int
    step: int
    paused: bool
    finished: bool
    max_steps: int
    groups_by_state: dict[str, int]
    queue_depths: dict[str, int]
    rollouts: list[RolloutStatus]
    staleness_mean: float
    logprob_abs_diff_max: float
    error: str
    reward_mean: float = 0.0
    loss: float = 0.0
    steps_per_second: float = 0.0
    tokens_per_second: float = 0.0
    sync_ms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # prepare, stage, commit, total
    weight_transport: str = ""
    uptime_seconds: float = 0.0
    source: str = "env"
    queue_capacity: int = 0
    group_size: int = 0
    groups_per_batch: int = 0
    level_success: dict[str, float] = field(default_factory=dict)  # an env's levels: recent success rates
