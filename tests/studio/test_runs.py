"""Which runs the studio lists, and what it says of one whose scheduler is not running."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition, NotFound, Unavailable
from services.launch import liveset
from services.studio.runs import Runs
from tests.scheduler.test_status_view import _serve


def _run(path: Path, *files: str) -> Path:
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_text("")
    return path


def test_runs_are_the_run_directories_under_the_root_and_the_named_ones_listed_once(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    a = _run(root / "a", "run.toml")
    _run(root / "not-a-run")
    elsewhere = _run(tmp_path / "elsewhere" / "a", "metrics.jsonl")
    runs = Runs(root, [a, elsewhere, root / ".." / "runs" / "a"], call_timeout_s=1)
    assert runs.all() == {"a": a.resolve(), str(elsewhere.resolve()): elsewhere.resolve()}
    with pytest.raises(NotFound, match="no run 'nope'"):
        runs.path("nope")


async def test_a_run_without_a_scheduler_or_a_record_is_empty_and_cannot_be_stopped(tmp_path: Path) -> None:
    runs = Runs(tmp_path, [], call_timeout_s=1)
    _run(tmp_path / "fresh", "run.toml")
    state = await runs.state("fresh")
    assert (state["live"], state["phase"], state["services"]) == (False, "empty", [])
    assert "no scheduler running" in state["why"]
    with pytest.raises(FailedPrecondition, match="not started by this studio"):
        runs.stop("fresh")
    with pytest.raises(FailedPrecondition, match="no scheduler running"):
        await runs.pause("fresh", True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_pause_sent_while_the_scheduler_restarts_lands_once_it_is_back(tmp_path: Path) -> None:
    run_dir = _run(tmp_path / "r", "run.toml")
    me = liveset.Member("launcher", os.getpid(), liveset.start_time(os.getpid()))
    liveset.write(run_dir, liveset.Record(me))  # its launcher lives: a restart is under way
    (run_dir / "scheduler.port").write_text(f"{_free_port()}\n")  # nothing listens there (yet)
    runs = Runs(tmp_path, [], call_timeout_s=1, control_wait_s=60)
    pause = asyncio.create_task(runs.pause("r", True))
    await asyncio.sleep(1.5)
    assert not pause.done()  # still waiting for the scheduler
    scheduler = await _serve(tmp_path / "scheduler")  # the real SchedulerApp (in-memory peers)
    try:
        (run_dir / "scheduler.port").write_text(f"{scheduler.port}\n")  # the restarted one's port
        assert await asyncio.wait_for(pause, 30) is True
        assert (await runs.status("r")).paused
        assert await runs.pause("r", False) is False
    finally:
        await scheduler.close()

    # with no launcher alive, nothing is coming back: the studio says so at once
    liveset.remove(run_dir)
    (run_dir / "scheduler.port").write_text(f"{_free_port()}\n")
    with pytest.raises(Unavailable, match="does not answer"):  # not TimeoutError: it did not wait 60 s
        await asyncio.wait_for(runs.pause("r", True), 30)
