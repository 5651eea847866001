"""One launcher per run directory, and nothing it started outlives it.

`RunOwner.claim(run_dir)` takes `<run-dir>/launcher.lock` with `flock(LOCK_EX)` for the launcher's
whole life (the kernel drops it when the launcher dies, SIGKILL included). A second launcher on the
same run directory gets `RunDirBusy` (the file names the holder's pid). Holding the lock, it stops
whatever the previous launcher's record (`liveset.py`) says still runs (a launcher that died while its
services somehow stayed up: frozen, or its watchdog killed too), so a run never has two sets.

While the launcher runs, its services are recorded as they start (`track`), and a watchdog process
(`watchdog.py`, in a session of its own) waits on a pipe from the launcher: the pipe closes when the
launcher exits however it exits, and the watchdog then stops the services still recorded. Each service
also gets SIGTERM from the kernel when the launcher dies (`processes.py`, PR_SET_PDEATHSIG); the
watchdog is for the ones that do not act on it (hung, stopped) and for what they started.

`release()` (after the launcher stopped its services) removes the record, reclaims the shared-memory
segments whose creator is gone (`reclaim_segments`), closes the watchdog's pipe and drops the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from services.launch import liveset

if TYPE_CHECKING:  # the watchdog imports this module: no gRPC for it
    from services.launch.processes import ServiceProcess

LOCK_FILE = "launcher.lock"
WATCHDOG_WAIT_S = 30.0  # how long a new launcher waits for a dead launcher's watchdog to finish


class RunDirBusy(RuntimeError):
    """Another launcher runs this run directory (`holder`: what its lock file says of it)."""

    def __init__(self, message: str, holder: dict | None = None) -> None:
        super().__init__(message)
        self.holder = holder or {}


def _holder(lock: IO[str]) -> dict:
    lock.seek(0)
    with contextlib.suppress(ValueError):
        return json.loads(lock.read() or "{}")
    return {}


def lock_run_dir(run_dir: Path, role: str, wait_for_watchdog_s: float = WATCHDOG_WAIT_S) -> IO[str]:
    """The open lock file, locked by this process (`role` is written in it for whoever is refused).
    RunDirBusy at once if a launcher holds it; a dead launcher's watchdog is waited for."""
    lock = (run_dir / LOCK_FILE).open("a+")
    deadline = time.monotonic() + wait_for_watchdog_s
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            holder = _holder(lock)
            if holder.get("role") == "watchdog" and time.monotonic() < deadline:
                time.sleep(0.2)  # it is stopping what a dead launcher left: a few seconds
                continue
            lock.close()
            who = f"{holder.get('role', 'a launcher')} with pid {holder.get('pid', '?')}"
            raise RunDirBusy(
                f"{run_dir} is in use by {who}; stop it first (SIGTERM) or choose another --run-dir", holder
            ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(json.dumps({"role": role, "pid": os.getpid()}))
    lock.flush()
    return lock


def reclaim_segments(say: Callable[[str], None] = print) -> list[str]:
    """Unlink our shared-memory segments whose creator is gone (`shared_memory.reclaim_stale_segments`,
    where that exists); says and returns what was reclaimed."""
    from services.transports import shared_memory  # torch: only when a launcher ends

    reclaim = getattr(shared_memory, "reclaim_stale_segments", None)
    if reclaim is None:
        return []
    try:
        names = list(reclaim())
    except OSError as exc:
        say(f"could not reclaim stale shared-memory segments: {exc}")
        return []
    if names:
        say(f"reclaimed {len(names)} stale shared-memory segment(s): {', '.join(names)}")
    return names


class RunOwner:
    """The launcher's hold on its run directory (see the module docstring)."""

    def __init__(self, run_dir: Path, lock: IO[str], say: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self.say = say
        self._lock: IO[str] | None = lock
        me = os.getpid()
        self.launcher = liveset.Member("launcher", me, liveset.start_time(me) or 0)
        self._processes: list[ServiceProcess] = []
        self._watchdog: subprocess.Popen | None = None

    @classmethod
    def claim(cls, run_dir: Path, say: Callable[[str], None] = print, grace_s: float = 10.0) -> RunOwner:
        """Lock the run directory (RunDirBusy if a launcher runs it), stop what a dead launcher left
        running there, and start the watchdog. Blocking (up to `grace_s` + a few seconds)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        owner = cls(run_dir, lock_run_dir(run_dir, "launcher"), say)
        if (previous := liveset.read(run_dir)) and (left := previous.alive()):
            names = ", ".join(f"{m.role} (pid {m.pid})" for m in left)
            say(f"stopping what launcher pid {previous.launcher.pid} left running: {names}")
            if still := liveset.stop(left, grace_s, say):
                owner.release()
                raise RunDirBusy(f"could not stop {', '.join(m.role for m in still)} of an earlier launcher")
        liveset.remove(run_dir)
        owner._start_watchdog()
        return owner

    def _start_watchdog(self) -> None:
        log = self.run_dir / "logs" / "watchdog.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as out:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "services.launch.watchdog", str(self.run_dir.resolve()),
                 str(self.launcher.pid), str(self.launcher.start_time)],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def track(self, process: ServiceProcess) -> None:
        """Record `process` in live.json from now on (at each of its starts and once its port is known)."""
        self._processes.append(process)
        process.on_change = self.save
        self.save()

    def save(self) -> None:
        members = [m for p in self._processes if (m := p.member()) is not None]
        liveset.write(self.run_dir, liveset.Record(self.launcher, members))

    def release(self) -> None:
        """After the launcher stopped its services: forget them, reclaim segments, let go of the run dir."""
        if self._lock is None:
            return
        if left := liveset.stop([m for p in self._processes if (m := p.member())], grace_s=5.0, say=self.say):
            self.say(f"still running after SIGKILL: {', '.join(f'{m.role} (pid {m.pid})' for m in left)}")
        else:
            liveset.remove(self.run_dir)
        reclaim_segments(self.say)
        self._lock.close()  # drops the flock
        self._lock = None
        if self._watchdog is not None and self._watchdog.stdin is not None:
            self._watchdog.stdin.close()  # it finds no record of this launcher and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=5.0)
