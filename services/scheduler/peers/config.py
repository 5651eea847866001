"""Settings of the scheduler's peer clients: `--timeouts.*` (a deadline on every call) and
`--generate-batch.*` (several groups to one rollout in one call)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TimeoutSettings(BaseModel):
    """Deadlines (seconds) of the scheduler's outbound calls."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect: float = Field(default=120.0, description="Waiting for a peer's channel to connect at start.")
    control: float = Field(
        default=30.0,
        description="Small control RPCs (state, sample prompts, release, abort, probe scoring).",
    )
    generate: float = Field(
        default=300.0, description="One GenerateBatch stream (its groups, from the call to the last one)."
    )
    score: float = Field(default=120.0, description="Scoring one group.")
    train_step: float = Field(default=600.0, description="One learner TrainStep.")
    weight_sync: float = Field(
        default=300.0,
        description="Each phase of one weight sync: the learner's prepare, a rollout's stage or commit.",
    )


class GenerateBatchSettings(BaseModel):
    """How the scheduler's groups travel to a rollout: several in one GenerateBatch call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    window_ms: float = Field(
        default=1.0,
        ge=0,
        description="How long a group's generation request waits for others to the same rollout before "
        "they go out together in one call (each call costs a few hundred microseconds of CPU at both "
        "ends); 0 = only those issued in the same event-loop turn.",
    )
    max_requests: int = Field(
        default=64, ge=1, description="Most groups in one GenerateBatch call (1 = a call per group)."
    )
