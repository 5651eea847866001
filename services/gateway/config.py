"""Settings of the OpenAI-compatible gateway: `[gateway]` and its nested tables, `GRPO_GATEWAY__*`, `--flags`.

    [gateway]            rollouts to route to, the served model name, the HTTP listener
    [gateway.limits]     request bounds (--limits.max-n 16)                     → schemas.py
    [gateway.admission]  in-flight bounds and Retry-After (--admission.per-rollout-in-flight 64)
    [gateway.sessions]   sticky sessions (--sessions.max-sessions 10000)       → sessions.py
    [gateway.timeouts]   deadlines of the gRPC calls to rollouts (--timeouts.generate-s 600)
    [gateway.record]     the JSONL call record (--record.path calls.jsonl)      → recorder.py
    [gateway.registry]   every generation served, for matching submitted sequences
                         (--registry.max-generations 100000)                   → registry.py

`--security.*` is the block every grpo-mesh service shares (services/common/security.py): the same
certificate serves HTTPS here, the same bearer token guards every route but /health, and the same
CA, client certificate and token dial the rollouts. The base fields' HTTP meaning: `--host`/`--port`
(0 = any free port, see `--port-file`), `--grace-seconds` (on SIGTERM, requests in flight get this
long), `--max-message-bytes` (the gRPC channels to the rollouts), `--max-concurrent-rpcs` (HTTP
connections served at once; beyond: 503).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GatewayLimits(_Section):
    """What one HTTP request may ask for; beyond: 400 naming the field, never an engine error."""

    max_n: int = Field(default=16, ge=1, le=256, description="Largest n (choices per request).")
    max_tokens: int = Field(default=4096, ge=1, description="Largest max_tokens / max_completion_tokens.")
    max_messages: int = Field(default=256, ge=1, description="Most chat messages in one request.")
    max_prompt_tokens: int = Field(
        default=32768, ge=1, description="Most prompt token ids in one token-in request."
    )
    max_body_bytes: int = Field(
        default=4 << 20, ge=1024, description="Largest request body in bytes; beyond: 413."
    )
    max_stop: int = Field(default=16, ge=0, description="Most stop strings per request.")
    max_text_chars: int = Field(
        default=1 << 20, ge=1, description="Longest prompt text or message content, in characters."
    )


class AdmissionConfig(_Section):
    """Backpressure: what the gateway accepts at once; beyond it answers 429 with Retry-After."""

    per_rollout_in_flight: int = Field(
        default=64,
        ge=1,
        description="Requests the gateway sends one rollout at once (keep it ≤ the rollout's "
        "--max-in-flight); when every usable rollout is at it, new requests get 429.",
    )
    retry_after_s: int = Field(default=1, ge=1, description="Retry-After (seconds) of a 429.")
    scheduler: str | None = Field(
        default=None,
        description="A training run's scheduler (host:port): 429 also while its run is paused or finished "
        "or every rollout is more than --admission.max-staleness versions behind the learner.",
    )
    max_staleness: int = Field(
        default=1, ge=0, description="The run's staleness bound (its --max-staleness)."
    )
    poll_interval_s: float = Field(default=1.0, gt=0, description="How often the scheduler's status is read.")


class SessionConfig(_Section):
    """Sticky sessions (`X-Session-ID`): a bounded LRU with a time to live."""

    max_sessions: int = Field(
        default=10_000, ge=1, description="Sessions remembered; the least recently used goes first."
    )
    ttl_s: float = Field(default=3600.0, gt=0, description="A session unused this long is forgotten.")
    max_session_id_chars: int = Field(default=256, ge=1, description="Longest X-Session-ID accepted.")


class GatewayTimeouts(_Section):
    """Deadlines of the gateway's gRPC calls to rollouts (every call has one)."""

    generate_s: float = Field(default=600.0, gt=0, description="One Generate call (all n choices).")
    control_s: float = Field(default=10.0, gt=0, description="RenderMessages and other short calls.")
    health_s: float = Field(default=2.0, gt=0, description="GetRolloutState (health and /v1/models).")
    health_interval_s: float = Field(
        default=2.0, gt=0, description="How often every rollout's state is polled in the background."
    )


class RecordConfig(_Section):
    """The standalone call record (recorder.py): one JSON line per call that names a session."""

    path: Path | None = Field(
        default=None, description="JSONL file the session calls are appended to; empty = not recorded."
    )
    max_pending: int = Field(
        default=1024,
        ge=1,
        description="Records waiting for the writer thread; beyond, new ones are dropped and counted.",
    )


class RegistrySettings(_Section):
    """The generation registry (registry.py): what a sequence submitted for training is matched against."""

    max_generations: int = Field(
        default=100_000,
        ge=1,
        description="Generations remembered (one per choice); the least recently used goes first.",
    )
    ttl_s: float = Field(
        default=3600.0, gt=0, description="A generation not added or matched this long is forgotten."
    )


class TrajectoryConfig(_Section):
    """atropos' trajectory API in front of a scheduler whose source is external (trajectories.py)."""

    scheduler: str | None = Field(
        default=None,
        description="The training run's scheduler (host:port, source = external): serves the trajectory "
        "API (/register-env, /status-env, /scored_data, ...) and sends matched groups to it; unset = off.",
    )
    hold_s: float = Field(
        default=120.0,
        gt=0,
        description="How long a submission waits for room in the trainer's queue (or for a restarting "
        "scheduler) before a 503.",
    )
    max_held: int = Field(default=256, ge=1, description="Submissions waiting at once; beyond, 503 at once.")
    submit_timeout_s: float = Field(
        default=30.0, gt=0, description="Deadline of one SubmitGroups call (the ledger write included)."
    )
    poll_interval_s: float = Field(
        default=1.0, gt=0, description="How often the scheduler's status is read (/status-env reads it)."
    )


class GatewaySettings(ServiceSettings):
    """OpenAI-compatible HTTP gateway in front of rollout workers (their gRPC API only).

    python -m services.gateway --rollouts 127.0.0.1:50052 127.0.0.1:50053 --port 8000
    """

    config_table: ClassVar[str] = "gateway"
    model_config = SettingsConfigDict(env_prefix="GRPO_GATEWAY__")

    rollouts: list[str] = Field(description="Rollout workers' gRPC addresses (host:port), one or more.")
    served_model_name: str = Field(
        default="grpo-mesh",
        description="The model id /v1/models lists; requests may name it or leave it out.",
    )
    owned_by: str = Field(default="grpo-mesh", description="owned_by of the /v1/models entry.")
    max_concurrent_rpcs: int = Field(
        default=1024, ge=1, description="HTTP connections served at once (uvicorn); beyond: 503."
    )
    keep_alive_s: float = Field(
        default=75.0,
        gt=0,
        description="An idle keep-alive connection is closed after this long. Longer than clients' own "
        "idle expiry (httpx: 5 s), so a client never reuses a connection the gateway is closing.",
    )
    limits: GatewayLimits = Field(default_factory=GatewayLimits, description="Request bounds.")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="Backpressure.")
    sessions: SessionConfig = Field(default_factory=SessionConfig, description="Sticky sessions.")
    timeouts: GatewayTimeouts = Field(default_factory=GatewayTimeouts, description="gRPC deadlines.")
    record: RecordConfig = Field(default_factory=RecordConfig, description="The JSONL call record.")
    trajectories: TrajectoryConfig = Field(
        default_factory=TrajectoryConfig, description="atropos' trajectory API (an external-source run)."
    )
    registry: RegistrySettings = Field(
        default_factory=RegistrySettings, description="The generation registry."
    )

    @field_validator("rollouts")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one rollout address (host:port)")
        for address in value:
            host, colon, port = address.rpartition(":")
            if not (host and colon and port.isdigit()):
                raise ValueError(f"{address!r} is not host:port")
        if len(set(value)) != len(value):
            raise ValueError("a rollout address is listed twice")
        return value
