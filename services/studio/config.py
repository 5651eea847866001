"""The studio's settings: `grpo-mesh studio --flags` (command-line only, like every grpo-mesh command).

grpo-mesh studio                              # http://127.0.0.1:7860, runs under ./runs
grpo-mesh studio --run-dir runs/demo          # open that run (live, finished or crashed)
grpo-mesh studio --port 0 --port-file F       # any free port, written to F (tests, the demo)
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from services.common.config import CommandSettings


class StudioSettings(CommandSettings):
    """A web studio: start a run from a form, watch its curves, read its trajectories from the ledger,
    talk to its policy. It reads runs through the scheduler's gRPC API and the run directory
    (metrics.jsonl, the ledger read-only); it never writes to a run directory it did not create."""

    host: str = Field(
        default="127.0.0.1", description="Address to bind (the studio has no login: keep it local)."
    )
    port: int = Field(default=7860, ge=0, le=65535, description="Port to bind; 0 picks a free one.")
    port_file: Path | None = Field(default=None, description="Write the bound port here once serving.")
    runs_root: Path = Field(
        default=Path("runs"), description="Where runs started from the form go, and which are listed."
    )
    run_dir: list[Path] = Field(
        default_factory=list, description="Runs to list besides those under --runs-root (repeatable)."
    )
    token: str = Field(
        default="",
        description="Require this token on every request (header `Authorization: Bearer`, or open "
        "`/?token=...` once: a cookie keeps it). Empty: none (fine on 127.0.0.1).",
    )
    token_file: Path | None = Field(default=None, description="Read --token from this file (a run's token).")
    call_timeout_s: float = Field(
        default=5.0, gt=0, description="Deadline of each GetStatus/Pause/Resume call."
    )
    control_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="How long Pause/Resume wait for a scheduler its launcher is restarting (or starting).",
    )
    generate_timeout_s: float = Field(default=120.0, gt=0, description="Deadline of a chat answer.")
    max_chat_tokens: int = Field(default=256, ge=1, le=4096, description="Longest chat answer allowed.")
