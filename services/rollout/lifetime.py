"""vLLM's engine processes must not outlive the rollout that started them.

vLLM starts an engine-core process under the rollout, and worker processes under the engine core with
its mp executor (tensor parallel; the uni executor, the rollout's default for one worker, runs the
worker inside the engine core). If the rollout is killed with SIGKILL it cannot stop them: measured
here, the engine core and its worker were all still alive 20 s after the rollout died, holding the
model's memory and ~250 MB of `/dev/shm` message queues while a restarted rollout loads a second copy.

The rollout records its pid in the environment its engine inherits (`OWNER_ENV`, set by `mark_owner()`
before the engine starts). Each worker then runs `die_with_owner()`, a daemon thread that polls that
pid: once the rollout is gone, it sends SIGTERM to its engine core (its parent, unless that is the
rollout itself) and itself, so vLLM shuts down and unlinks its shared memory (measured: all gone within
~10 s), and SIGKILL to both after `kill_after_s` if they are still there. Only these two pids are
signalled, never a process group or anything found by name. (PR_SET_PDEATHSIG is no help: it would fire
when the rollout's engine-starting *thread* exits, and it only covers the direct child.) The launcher
also clears a dead service's process group; this covers a rollout started by hand or by any supervisor.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil

OWNER_ENV = "GRPO_ENGINE_OWNER_PID"
_started = False


def mark_owner() -> None:
    """Called by the rollout before it starts its engine: the engine's processes watch this pid."""
    os.environ[OWNER_ENV] = str(os.getpid())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_owner(interval_s: float = 0.5, kill_after_s: float = 15.0) -> None:
    """Start (once per process) the watchdog that stops this process and its parent with the owner."""
    global _started
    owner = int(os.environ.get(OWNER_ENV, "0") or 0)
    if _started or owner <= 0 or owner == os.getpid():
        return
    _started = True
    parent = os.getppid()
    targets = [pid for pid in (parent, os.getpid()) if pid != owner]

    def stop(signum: int) -> None:
        for pid in targets:
            if _alive(pid):
                os.kill(pid, signum)

    def owner_alive() -> bool:
        # a dead owner nobody has reaped yet still answers os.kill(pid, 0): also notice that we or
        # our engine-core parent have been re-parented
        if not _alive(owner) or os.getppid() != parent:
            return False
        try:
            return parent == owner or psutil.Process(parent).ppid() == owner
        except psutil.NoSuchProcess:
            return False

    def watch() -> None:
        while owner_alive():
            time.sleep(interval_s)
        stop(signal.SIGTERM)  # vLLM's own shutdown: it unlinks its shared-memory queues
        time.sleep(kill_after_s)
        stop(signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-owner", daemon=True).start()
