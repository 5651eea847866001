"""A process that dies with its parent (Linux's PR_SET_PDEATHSIG; elsewhere a no-op)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def die_with_parent(parent: int, signum: int = signal.SIGTERM) -> None:
    """From now on this process gets `signum` when its parent exits; if `parent` is already gone (this
    process was re-parented before the signal was armed), it gets `signum` now."""
    if _libc is not None and _libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)
