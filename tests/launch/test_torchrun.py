"""`python -m services.launch.torchrun`: a learner of two ranks that stops cleanly, fails loudly and
never outlives its launcher. Real torchrun, real ranks (Gloo), real signals, found and sent by pid."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

LIMIT_S = 120  # a hard bound per wait: the test can never hang CI


def _start(model: Path, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    port_file, log = tmp_path / "learner.port", tmp_path / "learner.log"
    command = [
        sys.executable, "-m", "services.launch.torchrun", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "0", "-m", "services.learner", "--model", str(model), "--device", "cpu",
        "--port", "0", "--port-file", str(port_file), "--checkpoint.dir", str(tmp_path / "checkpoints"),
    ]  # fmt: skip
    with log.open("w") as out:
        launcher = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    started = time.monotonic()
    while not (port_file.exists() and port_file.read_text().strip()):
        assert launcher.poll() is None, log.read_text()[-4000:]
        assert time.monotonic() - started < LIMIT_S, "the learner did not start"
        time.sleep(0.2)
    return launcher, log


def _ranks(launcher: subprocess.Popen) -> dict[str, psutil.Process]:
    found = {}
    for process in psutil.Process(launcher.pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "services.learner" in process.cmdline() and "RANK" in process.environ():
                found[process.environ()["RANK"]] = process
    return found


@pytest.fixture
def cleanup():
    launched: list[subprocess.Popen] = []
    seen: list[psutil.Process] = []
    yield launched, seen
    for launcher in launched:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    for process in seen:
        with contextlib.suppress(psutil.Error):
            process.kill()


def test_sigterm_stops_every_rank_cleanly(tiny_model_dir: Path, tmp_path: Path, cleanup) -> None:
    launcher, log = _start(tiny_model_dir, tmp_path)
    cleanup[0].append(launcher)
    ranks = _ranks(launcher)
    cleanup[1].extend(ranks.values())
    assert sorted(ranks) == ["0", "1"]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=LIMIT_S) == 0, log.read_text()[-4000:]  # torchrun alone would exit 1
    output = log.read_text()
    assert '"event": "stopped", "service": "learner"' in output
    assert "SIGTERM: stopping when rank 0 says so" in output
    _, alive = psutil.wait_procs(list(ranks.values()), timeout=10)
    assert not alive


def test_a_killed_rank_takes_the_learner_down(tiny_model_dir: Path, tmp_path: Path, cleanup) -> None:
    launcher, log = _start(tiny_model_dir, tmp_path)
    cleanup[0].append(launcher)
    ranks = _ranks(launcher)
    cleanup[1].extend(ranks.values())
    ranks["1"].send_signal(signal.SIGKILL)
    assert launcher.wait(timeout=LIMIT_S) != 0, log.read_text()[-4000:]
    _, alive = psutil.wait_procs(list(ranks.values()), timeout=10)
    assert not alive


def test_the_ranks_die_with_the_launcher(tiny_model_dir: Path, tmp_path: Path, cleanup) -> None:
    launcher, _ = _start(tiny_model_dir, tmp_path)
    cleanup[0].append(launcher)
    everything = psutil.Process(launcher.pid).children(recursive=True)
    cleanup[1].extend(everything)
    launcher.send_signal(signal.SIGKILL)  # torchrun gets SIGKILL, the ranks SIGTERM: rank 0 stops them
    _, alive = psutil.wait_procs(everything, timeout=LIMIT_S)
    assert not alive, alive
