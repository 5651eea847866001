"""Scheduler settings: the `[scheduler]` table, `GRPO_SCHEDULER__*` env vars, `--help`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.advantages import AdvantageMode
from services.common.config import ServiceSettings
from services.scheduler.observe.tracking import TrackingSettings
from services.scheduler.peers.config import GenerateBatchSettings, TimeoutSettings
from services.transports import TransportKind
from services.transports.kinds import ImplementedTransport


class SamplingSettings(BaseModel):
    """Sampling for training rollouts. Keep top_p=1/top_k=0 so learner and behaviour logprobs match."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature (learner uses the same).")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling; 1.0 = off.")
    top_k: int = Field(default=0, ge=0, description="Top-k sampling; 0 = off.")
    max_tokens: int = Field(default=8, ge=1, description="Max completion tokens.")


class RecoverySettings(BaseModel):
    """Durability: the run's ledger (`<run_dir>/ledger.sqlite`) and waiting out restarting peers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    peer_restart_timeout: float = Field(
        default=600.0,
        gt=0,
        description="Seconds to wait for a learner or env that stopped answering (restarting, paused, "
        "frozen) to answer again before the run fails; the learner's model load counts against it.",
    )
    retry_interval: float = Field(
        default=1.0,
        gt=0,
        description="Seconds before the first new attempt to reach a peer that refused the connection "
        "(doubling per attempt up to retry_max_interval); a call that timed out is made again at once.",
    )
    retry_max_interval: float = Field(
        default=5.0, gt=0, description="The longest back-off between attempts to reach a peer that went away."
    )
    ledger_flush_interval: float = Field(
        default=0.25,
        gt=0,
        description="Seconds between background writes of the ledger (every batch is also written "
        "before the learner sees it); a crash loses at most this much issue/score bookkeeping, "
        "never data: unrecorded groups are generated again.",
    )


class CurriculumSettings(BaseModel):
    """The curriculum (pipeline/curriculum.py): draw train prompts from the env's difficulty levels
    whose recent success rate lies in a band."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        default=False,
        description="Draw each prompt's level by its recent success rate (the env must declare levels); "
        "off = the env's train stream, which interleaves its levels round-robin (uniform).",
    )
    band_low: float = Field(
        default=0.2, ge=0, le=1, description="Lowest success rate of a level to draw from."
    )
    band_high: float = Field(
        default=0.8, ge=0, le=1, description="Highest success rate of a level to draw from."
    )
    window: int = Field(
        default=8, ge=1, description="Recent scored groups per level its success rate is taken over."
    )
    seed: int = Field(default=0, description="Seed of the level draws (the run's seed).")

    @model_validator(mode="after")
    def _band(self) -> CurriculumSettings:
        if self.band_low > self.band_high:
            raise ValueError(f"band_low ({self.band_low}) must not exceed band_high ({self.band_high})")
        return self


class SchedulerSettings(ServiceSettings):
    """The orchestrator: pumps prompts to rollouts, scores, batches, trains and syncs weights."""

    config_table = "scheduler"
    model_config = SettingsConfigDict(env_prefix="GRPO_SCHEDULER__")

    source: Literal["env", "external"] = Field(
        default="env",
        description="Where train groups come from: env = prompts drawn from the env service, generated "
        "and scored by the scheduler; external = SubmitGroups, from a harness (an atropos env, a "
        "verifiers runner) that generates through the gateway and scores itself (no env service; "
        "docs/ecosystem.md).",
    )
    env_address: str = Field(
        default="127.0.0.1:50051", description="Environment service host:port (source = env)."
    )
    learner_address: str = Field(default="127.0.0.1:50053", description="Learner service host:port.")
    rollout_addresses: list[str] = Field(
        default_factory=lambda: ["127.0.0.1:50052"],
        description="Rollout services host:port (more can join with RegisterWorker).",
    )
    max_rollouts: int = Field(
        default=256, ge=1, description="Most rollouts the run knows (configured + RegisterWorker)."
    )
    forget_unreachable_after: float = Field(
        default=300.0,
        gt=0,
        description="Seconds after which a rollout that joined with RegisterWorker and stopped answering "
        "is forgotten (it may register again).",
    )
    group_size: int = Field(default=8, ge=2, description="Completions per prompt (G).")
    groups_per_batch: int = Field(default=16, ge=1, description="Prompt groups per optimizer step (B).")
    max_steps: int = Field(
        default=0, ge=0, description="Stop after this many optimizer steps; 0 = run until stopped."
    )
    max_staleness: int = Field(
        default=1,
        ge=0,
        description="Max versions between the oldest token of a group and the step that trains it "
        "(0 = on-policy). Enforced by admission control; late groups are dropped and re-issued.",
    )
    advantage_mode: AdvantageMode | Literal["auto"] = Field(
        default="auto",
        description="How rewards become advantages; auto = the usual mode for the learner's loss.",
    )
    weight_transport: ImplementedTransport = Field(
        default=TransportKind.grpc_stream,
        description=(
            "How rollouts receive new weights: grpc_stream (anywhere), shared_memory (same host), "
            "nccl (a broadcast group; Gloo on CPU) or cuda_ipc (the learner's GPU)."
        ),
    )
    alignment_threshold: float = Field(
        default=1e-3,
        gt=0,
        description="Max |learner - rollout| logprob on the probe after a sync before failing.",
    )
    alignment_action: Literal["fail", "warn"] = Field(
        default="fail", description="What to do when the alignment probe exceeds the threshold."
    )
    alignment_probe_temperature: float = Field(
        default=1.0,
        ge=0,
        description="Temperature the probe is scored at on both sides; 0 = the run's sampling temperature. "
        "At 1.0 vLLM scores it in one request (prompt logprobs); at another temperature it takes one "
        "request per token, which on a busy CPU rollout can take longer than the probe's deadline.",
    )
    alignment_probe_tokens: int = Field(
        default=32,
        ge=1,
        description="Completion tokens of the probe (at most sampling.max_tokens). Differing weights or "
        "logprob conventions show at every position; what the probe costs the learner and the rollouts "
        "after each sync grows with its length.",
    )
    eval_every: int = Field(
        default=0, ge=0, description="Evaluate on the env's eval split every N steps; 0 = off."
    )
    eval_prompts: int = Field(default=64, ge=1, description="Eval prompts per evaluation.")
    eval_samples: int = Field(
        default=1, ge=1, description="Completions per eval prompt (pass@k for k ≤ this)."
    )
    eval_temperature: float = Field(default=1.0, gt=0, description="Sampling temperature for evaluation.")
    dynamic_sampling: bool = Field(
        default=False,
        description="DAPO dynamic sampling: drop groups whose rewards have zero variance (no gradient) "
        "and fill the batch from the stream instead; recorded as filtered in the ledger.",
    )
    prompt_buffer: int = Field(
        default=64, ge=1, description="Prompts fetched ahead from the env (bounded queue)."
    )
    health_interval_seconds: float = Field(default=2.0, gt=0, description="How often rollouts are polled.")
    autostart: bool = Field(default=True, description="Start training as soon as the peers are ready.")
    run_dir: Path = Field(
        default=Path("runs/latest"),
        description="Where metrics.jsonl and the ledger (ledger.sqlite) live; a scheduler restarted on "
        "the same directory continues the run from its ledger.",
    )
    trace: bool = Field(
        default=False,
        description="Write <run_dir>/trace.json, a timeline of the run (each group's generate and score, "
        "each train step, each weight sync's phases and probe) to open in ui.perfetto.dev; "
        "services/scheduler/observe/timeline.py.",
    )
    sampling: SamplingSettings = Field(default_factory=SamplingSettings, description="Training sampling.")

    @model_validator(mode="after")
    def _external_has_no_env(self) -> SchedulerSettings:
        if self.source == "external" and self.eval_every:
            raise ValueError("eval_every needs the env service: set it to 0 with source = external "
                             "(the harness evaluates itself)")  # fmt: skip
        return self

    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings, description="Client-call deadlines.")
    generate_batch: GenerateBatchSettings = Field(
        default_factory=GenerateBatchSettings, description="Groups sent to a rollout together in one call."
    )
    tracking: TrackingSettings = Field(
        default_factory=TrackingSettings, description="TensorBoard and Weights & Biases curves of the run."
    )
    recovery: RecoverySettings = Field(
        default_factory=RecoverySettings, description="Ledger writes and peer restarts."
    )
    curriculum: CurriculumSettings = Field(
        default_factory=CurriculumSettings,
        description="Draw train prompts from the env's difficulty levels by their recent success rate "
        "(pipeline/curriculum.py); off by default.",
    )
