"""Power loss, end to end: the ledger loses its last transactions, the learner's checkpoints survive.

`grpo-mesh demo` (all four services as processes; the transformers engine, so no vLLM is needed)
trains with a checkpoint every 2 steps, all kept. At step K a consistent copy of the ledger is taken (SQLite's
backup API): it stands for the ledger as a power loss leaves it, its later transactions lost.
Training goes on at least three steps past what that copy accounts for, then every process is
frozen (SIGSTOP: no step more) and killed with SIGKILL, the copy is put back in place of the ledger,
and the demo is started again with `--resume`. The learner's newest checkpoint is now ahead of the
ledger: the run must go back to a checkpoint the ledger accounts for
(`services/scheduler/ledger/recovery.py` states the rule), finish every step, and pass
`grpo-mesh audit`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from services.scheduler.ledger.store import FILE_NAME, read_ledger
from tests.e2e.runs import audit, trained_step

pytestmark = [pytest.mark.slow]

# A step of the tiny model takes ~50 ms here, so the test's polls see the run only now and then: a
# copy taken once it sees step COPY_AT may hold several steps more (CI's held 9 at step 3), and the run
# trains on while the test looks. STEPS leaves the run room for that: it must not end before the kill.
STEPS = 40
COPY_AT = 3  # the ledger copied once metrics.jsonl shows this step
AHEAD = 3  # steps trained after what the copy accounts for, before the power goes
POLL_S = 0.05
PHASE_LIMIT_S = 420  # a hard bound per phase: the test can never hang CI


def _demo(run_dir: Path, model: Path, log: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "services", "demo", "--steps", str(STEPS), "--run-dir", str(run_dir),
        "--model", str(model), "--engine", "transformers", "--device", "cpu", "--eval-every", "0",
        "--groups-per-batch", "4", "--group-size", "4", "--checkpoint-every", "2", *extra,
    ]  # fmt: skip
    with log.open("a") as out:
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "GRPO_LEARNER__CHECKPOINT__KEEP": "50"},  # the demo has no flag for it
        )  # fmt: skip


def _wait(launcher: subprocess.Popen, until, what: str) -> None:
    started = time.monotonic()
    while not until():
        assert launcher.poll() is None, f"the demo exited ({launcher.returncode}) before {what}"
        assert time.monotonic() - started < PHASE_LIMIT_S, f"timed out waiting for {what}"
        time.sleep(POLL_S)


def _kill_all(launcher: subprocess.Popen, seen: set[psutil.Process]) -> None:
    """Freeze, then SIGKILL, the launcher and everything it started, by pid (the power goes: nobody
    cleans up). Frozen first, so that no process trains, commits or starts another while others die."""
    with contextlib.suppress(psutil.NoSuchProcess):
        seen.update(psutil.Process(launcher.pid).children(recursive=True))
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for process in [psutil.Process(launcher.pid), *seen]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                process.send_signal(sig)
    launcher.wait(timeout=30)
    psutil.wait_procs(list(seen), timeout=30)


def _copy_ledger(run_dir: Path, to: Path) -> None:
    source = sqlite3.connect(f"file:{run_dir / FILE_NAME}?mode=ro", uri=True, timeout=30)
    target = sqlite3.connect(to)
    try:
        source.backup(target)
    finally:
        source.close()
        target.close()


def _checkpoint_steps(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in root.glob("step_*") if (p / "state.json").exists())


def test_a_run_survives_a_power_loss_that_takes_the_ledgers_last_writes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "launcher.log"
    copy_dir = tmp_path / "ledger-at-copy"
    copy_dir.mkdir()
    seen: set[psutil.Process] = set()
    launcher = _demo(run_dir, tiny_model_dir, log)
    try:
        _wait(launcher, lambda: trained_step(run_dir) >= COPY_AT, f"step {COPY_AT}")
        _copy_ledger(run_dir, copy_dir / FILE_NAME)
        known = max(read_ledger(copy_dir).batches) + 1  # steps the copy accounts for
        assert known + AHEAD < STEPS, f"the copy holds {known} of {STEPS} steps: no room to train past it"
        _wait(
            launcher,
            lambda: (
                trained_step(run_dir) >= known + AHEAD and max(_checkpoint_steps(run_dir), default=0) > known
            ),
            f"step {known + AHEAD}",
        )
        _kill_all(launcher, seen)  # the power goes
        for suffix in ("", "-wal", "-shm"):
            (run_dir / f"{FILE_NAME}{suffix}").unlink(missing_ok=True)
        os.replace(copy_dir / FILE_NAME, run_dir / FILE_NAME)  # what the disk kept of the ledger
        assert max(_checkpoint_steps(run_dir)) > known, "the learner's checkpoint must be ahead"

        launcher = _demo(run_dir, tiny_model_dir, log, "--resume", "--max-restarts", "0")
        started = time.monotonic()
        while launcher.poll() is None:
            assert time.monotonic() - started < PHASE_LIMIT_S, "the resumed run did not finish in time"
            with contextlib.suppress(psutil.NoSuchProcess):
                seen.update(psutil.Process(launcher.pid).children(recursive=True))
            time.sleep(0.2)
        output = log.read_text()
        assert launcher.returncode == 0, output[-6000:]
    finally:
        if launcher.poll() is None:
            _kill_all(launcher, seen)
        for process in seen:  # whatever is left after a failure: ours, by pid
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                process.send_signal(signal.SIGKILL)

    audit_output, counts = audit(run_dir)
    assert int(counts["steps"]) == STEPS and int(counts["groups_trained"]) == STEPS * 4
    snapshot = read_ledger(run_dir)
    restores = [detail for kind, _, detail in snapshot.events if kind == "learner_restore"]
    # back to the newest checkpoint the ledger accounts for (all are kept: one of the last two steps)
    assert len(restores) == 1 and known - 2 < restores[0]["to_step"] <= known < restores[0]["from_step"]
    rewinds = [detail for kind, _, detail in snapshot.events if kind == "learner_rewind"]
    assert rewinds and rewinds[0]["from_version"] >= restores[0]["from_step"], rewinds
    print(audit_output, restores, rewinds)
