"""The launcher's watchdog: what a launcher started does not outlive it, even when it dies by SIGKILL.

    python -m services.launch.watchdog RUN_DIR LAUNCHER_PID LAUNCHER_START_TIME

Started by the launcher (`ownership.py`) in a session of its own, with its stdin a pipe whose only
writer is the launcher. It blocks reading it (no polling, no CPU) until the pipe closes, which the
kernel does when the launcher exits, however it exits. If the run directory's record (`liveset.py`)
is still this launcher's (the launcher removes it after stopping its services, and a new launcher
replaces it), it takes the run directory's lock, stops the recorded services that still run (SIGTERM,
SIGKILL of their process groups after a grace), reclaims stale shared-memory segments and removes the
record. If a new launcher holds the lock first, that one stops them (`RunOwner.claim`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from services.launch import liveset
from services.launch.ownership import RunDirBusy, lock_run_dir, reclaim_segments

GRACE_S = 10.0


def say(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} watchdog: {text}", flush=True)


def watch(run_dir: Path, launcher: liveset.Member, grace_s: float = GRACE_S) -> int:
    """After the launcher is gone: stop what its record says still runs. Returns how many services."""
    record = liveset.read(run_dir)
    if record is None or record.launcher != launcher:
        return 0  # it stopped its services itself, or a new launcher has taken over
    deadline = time.monotonic() + 10.0
    while True:
        try:
            lock = lock_run_dir(run_dir, "watchdog", wait_for_watchdog_s=0)
            break
        except RunDirBusy as busy:  # the launcher's lock goes with its last file descriptor
            if busy.holder.get("pid") != launcher.pid or time.monotonic() > deadline:
                say(f"{busy}: leaving the services recorded there to it")
                return 0
            time.sleep(0.1)
    with lock:
        record = liveset.read(run_dir)
        if record is None or record.launcher != launcher:
            return 0
        left = record.alive()
        if left:
            say(f"launcher pid {launcher.pid} is gone; stopping {', '.join(m.role for m in left)}")
            if still := liveset.stop(left, grace_s, say):
                say(f"still running after SIGKILL: {', '.join(f'{m.role} (pid {m.pid})' for m in still)}")
                return len(left)
        reclaim_segments(say)
        liveset.remove(run_dir)
        return len(left)


def main(argv: list[str]) -> int:
    run_dir, pid, started = Path(argv[0]), int(argv[1]), int(argv[2])
    sys.stdin.buffer.read()  # returns at EOF: the launcher closed the pipe or died
    watch(run_dir, liveset.Member("launcher", pid, started))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
