"""torchrun for the learner's ranks, with a clean stop: `python -m services.launch.torchrun ARGS...`.

ARGS are torchrun's own (`--nproc-per-node 2 --standalone -m services.learner ...`). torchrun answers
SIGTERM by signalling its workers and then exiting 1 itself, however cleanly they stopped. A learner
stopped on purpose (the demo's stop, `docker compose stop`, a pod deleted) would then look crashed,
and a restart policy would start it again.

So this process starts torchrun with SIGTERM ignored (its workers install their own handlers) and, on
SIGTERM or SIGINT, signals the ranks itself, by pid. Rank 0 drains, writes the final checkpoint with
the other ranks and tells them to stop (services/learner/ranks.py); they all exit 0, so torchrun does
too, and this process exits with torchrun's code. A rank that fails still makes torchrun exit non-zero.
torchrun dies with this process (SIGKILL), and the ranks die with torchrun (sharding.join).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import psutil

from services.common.parent_death import die_with_parent

HANDLED = "SIGINT,SIGHUP,SIGQUIT"  # torchrun's own handling, SIGTERM left out (ignored instead)


def _start(argv: Sequence[str]) -> subprocess.Popen:
    me = os.getpid()

    def prepare() -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        die_with_parent(me, signal.SIGKILL)

    command = [sys.executable, "-m", "torch.distributed.run", "--signals-to-handle", HANDLED, *argv]
    return subprocess.Popen(command, preexec_fn=prepare)


def _signal_ranks(torchrun: subprocess.Popen, signum: int) -> None:
    """`signum` to every worker torchrun started (its children, found by pid)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        for rank in psutil.Process(torchrun.pid).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.send_signal(signum)


def main(argv: Sequence[str] | None = None) -> int:
    torchrun = _start(sys.argv[1:] if argv is None else argv)

    def stop(signum: int, frame: object) -> None:
        _signal_ranks(torchrun, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return torchrun.wait()


if __name__ == "__main__":
    sys.exit(main())
