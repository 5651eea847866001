"""`python -m services.scheduler`: settings → SchedulerApp → the shared serve skeleton."""

from __future__ import annotations

from services.common.serve import run_service
from services.scheduler.app import SchedulerApp
from services.scheduler.config import SchedulerSettings


def main(argv: list[str] | None = None) -> None:
    settings = SchedulerSettings.from_cli(argv, prog="python -m services.scheduler")
    run_service("scheduler", lambda: SchedulerApp(settings), settings)
