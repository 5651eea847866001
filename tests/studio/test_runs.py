"""Which runs the studio lists, and what it says of one whose scheduler is not running."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.studio.runs import Runs


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
