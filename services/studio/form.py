"""The studio's start form: what a run may be started with, checked before anything starts.

`StartForm` is a pydantic model, so an impossible value (0 steps, a group of one, a negative learning
rate, an unknown environment option) comes back as one message per field (`field_errors`) and no
process is started. `demo_argv` turns a valid form into the `grpo-mesh demo` command line.
"""

from __future__ import annotations

import re
import shutil
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from services.common.advantages import LossKind

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
ENV_SPEC = re.compile(r"^([A-Za-z_][\w.]*|[\w./-]+\.py):[A-Za-z_]\w*$")  # module:Class or file.py:Class
MODELS = {"tiny": "", "smollm2": "smollm2"}  # form value → the demo's --model
TRANSPORTS = ("grpc_stream", "shared_memory", "nccl", "cuda_ipc", "checkpoint")


class StartForm(BaseModel):
    """One run of the embedded demo (`grpo-mesh demo`), as the form submits it."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="", description="Run directory name under the studio's runs root.")
    model: Literal["tiny", "smollm2"] = "tiny"
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    env: str = Field(default="arithmetic", min_length=1, max_length=300)
    env_args: list[str] = Field(default_factory=list, max_length=32)
    loss: LossKind = LossKind.grpo
    steps: int = Field(default=40, ge=1, le=100_000)
    transport: Literal["grpc_stream", "shared_memory", "nccl", "cuda_ipc", "checkpoint"] = "grpc_stream"
    group_size: int | None = Field(default=None, ge=2, le=256, description="G (GRPO needs at least 2).")
    groups_per_batch: int | None = Field(default=None, ge=1, le=1024)
    lr: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, ge=1, le=8192)
    lora_rank: int | None = Field(default=None, ge=0, le=1024)
    seed: int | None = Field(default=0, ge=0, le=2**31 - 1)
    eval_every: int | None = Field(default=None, ge=0, le=100_000)
    curriculum: bool = Field(default=False, description="Draw from the env's levels by recent success.")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value and not NAME.match(value):
            raise ValueError("letters, digits, '_', '-' and '.', at most 64, starting with a letter or digit")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: str) -> str:
        value = value.strip()
        builtin = value in ("arithmetic", "gsm8k", "tool_arithmetic", "guessing")
        if not builtin and not value.startswith("reasoning_gym:") and not ENV_SPEC.match(value):
            raise ValueError(
                "a built-in (arithmetic, gsm8k, tool_arithmetic, guessing, reasoning_gym:<task>) or an "
                "import path module:Class or file.py:Class"
            )
        return value

    @field_validator("env_args")
    @classmethod
    def _env_args(cls, value: list[str]) -> list[str]:
        items = [v.strip() for v in value if v.strip()]
        for item in items:
            key, sep, _ = item.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"{item!r}: expected key=value")
        return items

    @field_validator("transport")
    @classmethod
    def _transport(cls, value: str) -> str:
        if value == "cuda_ipc" and shutil.which("nvidia-smi") is None:
            raise ValueError("cuda_ipc needs an NVIDIA GPU, and this machine has none")
        return value

    @model_validator(mode="after")
    def _shape(self) -> StartForm:
        if self.eval_every and self.eval_every > self.steps:
            raise ValueError(f"eval_every ({self.eval_every}) is more than the run's {self.steps} steps")
        return self


def field_errors(exc: ValidationError) -> dict[str, str]:
    """field name → message ("form" for a problem of the whole form)."""
    out: dict[str, str] = {}
    for error in exc.errors():
        where = str(error["loc"][0]) if error["loc"] else "form"
        message = error["msg"].removeprefix("Value error, ")
        out.setdefault(where, message)
    return out


def demo_argv(form: StartForm, run_dir: str) -> list[str]:
    """`grpo-mesh demo` arguments for the form (unset fields keep the demo's and the model's defaults)."""
    argv = ["--run-dir", run_dir, "--steps", str(form.steps), "--env", form.env, "--loss", form.loss.value]
    argv += ["--transport", form.transport, "--engine", form.engine]
    if MODELS[form.model]:
        argv += ["--model", MODELS[form.model]]
    for item in form.env_args:
        argv += ["--env-arg", item]
    optional: dict[str, Any] = {
        "--group-size": form.group_size, "--groups-per-batch": form.groups_per_batch, "--lr": form.lr,
        "--max-tokens": form.max_tokens, "--lora-rank": form.lora_rank, "--seed": form.seed,
        "--eval-every": form.eval_every,
    }  # fmt: skip
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if form.curriculum:
        argv.append("--curriculum")
    return argv
