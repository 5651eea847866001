"""Settings of the scheduler's peer clients: `--timeouts.*` (a deadline on every call) and
`--generate-batch.*` (several groups to one rollout in one call)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from services.common.deadlines import TransferDeadline


class TimeoutSettings(BaseModel):
    """Deadlines (seconds) of the scheduler's outbound calls."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    connect: float = Field(default=120.0, description="Waiting for a peer's channel to connect at start.")
    control: float = Field(
        default=30.0,
        description="Small control RPCs (learner state, sample prompts, release, abort, learner scoring).",
    )
    health: float = Field(
        default=10.0,
        gt=0,
        description="A rollout's state poll (health round): one that does not answer in time is taken out "
        "of work, its groups given to others, until it answers again.",
    )
    probe: float = Field(
        default=2.0,
        gt=0,
        description="A rollout's answer to the alignment probe after a sync, plus a probe token's share "
        "(--timeouts.probe-tokens-per-s); one that does not answer in time is taken out of work and "
        "probed after its next sync.",
    )
    probe_tokens_per_s: float = Field(
        default=20.0,
        gt=0,
        description="The slowest rate (tokens/s) at which a healthy rollout scores the probe: each of its "
        "tokens adds 1/rate seconds to --timeouts.probe (a multi-turn probe is hundreds of tokens long).",
    )
    generate: float = Field(
        default=300.0, description="One GenerateBatch stream (its groups, from the call to the last one)."
    )
    score: float = Field(default=120.0, description="Scoring one group.")
    train_step: float = Field(default=600.0, description="One learner TrainStep.")
    weight_sync: float = Field(
        default=300.0,
        description="The learner's prepare of a weight version (packing it for the rollouts); a rollout's "
        "commit when the version's size is unknown.",
    )
    transfer: TransferDeadline = Field(
        default_factory=lambda: TransferDeadline(floor_s=2.0, min_rate_mb_s=50.0),
        description="A rollout's stage and its commit of a version of `total_bytes`: floor_s + bytes at "
        "min_rate_mb_s (a collective transport's own bound when longer). A rollout that misses it is "
        "dropped from the sync, so a hung one holds training no longer than this; it gets the current "
        "version before any work when it answers again.",
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
