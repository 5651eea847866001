"""Stopping recorded services with real processes and real signals: verified by start time, SIGTERM
first (a stopped one is woken to act on it), SIGKILL of the whole process group after the grace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.launch import liveset

# ignores SIGTERM and starts a child in its own process group, as a hung service with its engine would
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print('up', flush=True); "
    "time.sleep(600)"
)
# acts on SIGTERM by writing a file, then exits
GRACEFUL = (
    "import signal, sys, time, pathlib; "
    "signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path(sys.argv[1]).write_text('bye'), sys.exit(0))); "
    "print('up', flush=True); time.sleep(600)"
)


def _start(code: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    return proc


def _member(proc: subprocess.Popen) -> liveset.Member:
    started = liveset.start_time(proc.pid)
    assert started is not None
    return liveset.Member("env", proc.pid, started)


def test_start_time_names_one_process() -> None:
    assert liveset.start_time(os.getpid()) == liveset.start_time(os.getpid()) is not None
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    member = _member(done)
    done.wait()  # reaped: no such process
    assert liveset.start_time(done.pid) is None and not member.running() and member.leftovers() == []


def test_a_zombie_is_not_running() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    member = _member(child)
    deadline = time.monotonic() + 30
    while member.running():  # exited but not reaped yet: a zombie, which has stopped
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert liveset.start_time(child.pid) == member.start_time  # still in the process table
    child.wait()


def test_stop_kills_a_service_that_ignores_sigterm_and_what_it_started() -> None:
    proc = _start(STUBBORN)
    member = _member(proc)
    assert len(member.leftovers()) == 2  # the service and its child
    said: list[str] = []
    assert liveset.stop([member], grace_s=1.0, say=said.append) == []
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert member.leftovers() == [], "its child outlived it"
    assert said == [f"env (pid {proc.pid}) ignored SIGTERM for 1 s: SIGKILL"]


def test_a_stopped_service_is_woken_to_act_on_its_sigterm(tmp_path: Path) -> None:
    proc = _start(GRACEFUL, str(tmp_path / "bye"))
    os.killpg(proc.pid, signal.SIGSTOP)  # frozen: SIGTERM alone would stay pending until the SIGKILL
    assert liveset.stop([_member(proc)], grace_s=60.0) == []
    assert proc.wait(timeout=10) == 0 and (tmp_path / "bye").read_text() == "bye"


def test_a_pid_with_another_start_time_is_never_signalled() -> None:
    proc = _start(STUBBORN)
    try:
        stranger = liveset.Member("env", proc.pid, _member(proc).start_time - 1)  # the pid, reused
        assert not stranger.running() and stranger.leftovers() == []
        assert liveset.stop([stranger], grace_s=0.5) == []
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_record_round_trips_and_is_replaced_whole(tmp_path: Path) -> None:
    assert liveset.read(tmp_path) is None
    record = liveset.Record(liveset.Member("launcher", 1, 2), [liveset.Member("env", 3, 4, 5)])
    liveset.write(tmp_path, record)
    assert liveset.read(tmp_path) == record
    assert [p.name for p in tmp_path.iterdir()] == [liveset.LIVE_FILE]  # no temporary left
    (tmp_path / liveset.LIVE_FILE).write_text("{half")
    assert liveset.read(tmp_path) is None
    liveset.remove(tmp_path)
    liveset.remove(tmp_path)
