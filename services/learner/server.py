"""Learner wiring: settings → LearnerApp → the shared server skeleton.

    python -m services.learner --model PATH --port 50052 --loss dapo

Rollouts fetch weights from the address this learner advertises. With `--port 0` the skeleton
would pick the port only after the app is built, so a free port is reserved here first (unless
`--advertise-address` is given), keeping the advertised address right.
"""

from __future__ import annotations

import socket
import sys

from services.common.serve import run_service
from services.learner.app import LearnerApp
from services.learner.config import LearnerSettings


def free_port(host: str) -> int:
    """A port that is free right now on `host` (the OS picks it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    settings = LearnerSettings.from_cli(argv, prog="python -m services.learner")
    if not settings.model:
        sys.exit("error: --model is required (HF model id or local directory)")
    if settings.port == 0 and not settings.advertise_address:
        settings = settings.model_copy(update={"port": free_port(settings.host)})
    run_service("learner", lambda: LearnerApp(settings), settings)
