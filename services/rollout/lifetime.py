"""vLLM's engine processes must not outlive the rollout that started them.

vLLM starts its engine core (and, with several workers, worker processes) as children of the rollout
process. If the rollout is killed with SIGKILL it cannot stop them, and they used to stay alive for
tens of seconds or more, holding the model's memory while a restarted rollout loads a second copy.
`die_with_parent()` runs a daemon thread in such a child that watches its parent pid: once the
parent is gone (the child is re-parented), the child kills itself. (PR_SET_PDEATHSIG is not used: it
fires when the *thread* that started the child exits, and the rollout starts its engine from a
worker thread.) The launcher also kills a dead service's whole process group; this covers a rollout
started by hand or by any other supervisor.
"""

from __future__ import annotations

import os
import signal
import threading
import time

_started = False


def die_with_parent(interval_s: float = 0.5) -> None:
    """Start (once per process) the watchdog that SIGKILLs this process when its parent dies."""
    global _started
    if _started:
        return
    _started = True
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:  # re-parented: the process that started us is dead
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()
