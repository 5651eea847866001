"""Learner wiring: settings → LearnerApp → the shared server skeleton.

    python -m services.learner --model PATH --port 50052 --loss dapo

Rollouts fetch weights from the address this learner advertises: `--advertise-address`, or
host:port as bound (the skeleton sets `app.bound_port` before `start()`, so `--port 0` works).
"""

from __future__ import annotations

import sys

from services.common.serve import run_service
from services.learner.app import LearnerApp
from services.learner.config import LearnerSettings


def main(argv: list[str] | None = None) -> None:
    settings = LearnerSettings.from_cli(argv, prog="python -m services.learner")
    if not settings.model:
        sys.exit("error: --model is required (HF model id or local directory)")
    run_service("learner", lambda: LearnerApp(settings), settings)
