"""`grpo-mesh prepare --config RUN_CONFIG`: the one-shot step a deployment runs before the services
start (compose's `init` service runs `python -m services prepare ...`: the image has no console
script): builds the project's tiny model where the run-config's `[prepare]` table asks for it, so a
run needs no model download.

    [prepare]
    tiny_model = "/data/models/tiny"   # built here unless it already exists (then a no-op)
    warm_start_steps = 120             # supervised warm start on the demo task (tiny_model.py)

A run-config without `[prepare]` (e.g. one that names a Hugging Face model id) makes this a no-op; the
services never read the table.
"""

from __future__ import annotations

import sys
import time
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.config import CommandSettings, parse_cli
from services.common.logging import configure_logging, get_logger

log = get_logger(__name__)
PROG = "grpo-mesh prepare"


class PrepareCommand(CommandSettings):
    """Prepare what a run-config's [prepare] table asks for before the services start: build the
    project's tiny model into `tiny_model` (kept if it is already there), so a run needs no model
    download. A run-config without a [prepare] table makes this a no-op; the services never read it.

    Exit 0 done (or nothing to do), 2 when the table or the command line is wrong.
    """

    config: Path = Field(description="The run-config (TOML) whose [prepare] table says what to prepare.")


class PrepareSettings(BaseModel):
    """The `[prepare]` table of a run-config."""

    model_config = ConfigDict(extra="forbid")

    tiny_model: Path | None = Field(
        None, description="Build the project's tiny model into this directory (kept if it exists)."
    )
    warm_start_steps: int = Field(
        120, ge=0, le=100_000, description="Supervised warm-start steps on the demo task (as the demo)."
    )


def prepare(settings: PrepareSettings) -> Path | None:
    """Do what the table asks; returns the tiny model's directory, if one was asked for."""
    if settings.tiny_model is None:
        log.info("nothing to prepare")
        return None
    from services.launch.tiny_model import build_tiny_model  # torch: only when a model is built

    started = time.perf_counter()
    existed = (settings.tiny_model / "config.json").exists()
    path = build_tiny_model(settings.tiny_model, warm_start_steps=settings.warm_start_steps)
    log.info(
        "tiny model ready",
        path=str(path),
        built=not existed,
        seconds=round(time.perf_counter() - started, 1),
    )
    return path


def parse(argv: list[str], prog: str = PROG) -> PrepareCommand:
    """The command line; SystemExit(2) on a bad one (the file is read by `main`)."""
    return parse_cli(PrepareCommand, argv, prog)


def main(argv: list[str]) -> int:
    args = parse(argv)
    configure_logging(service="prepare")
    try:
        with args.config.open("rb") as handle:
            table = tomllib.load(handle).get("prepare", {})
    except (OSError, tomllib.TOMLDecodeError) as exc:
        print(f"{PROG}: error: --config: {exc}", file=sys.stderr)
        return 2
    try:
        settings = PrepareSettings.model_validate(table)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        print(f"error: [prepare] in {args.config}: {problems}", file=sys.stderr)
        return 2
    prepare(settings)
    return 0
