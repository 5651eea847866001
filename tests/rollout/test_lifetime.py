"""The rollout's engine processes die with it: a rollout-like owner starts an engine-core-like child,
which starts a worker-like grandchild running `die_with_owner` (vLLM's mp executor) or runs it
itself (the uni executor: the worker lives in the engine core); SIGKILL of the owner stops them all."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

WORKER = (
    "from services.rollout.lifetime import die_with_owner; import time; "
    "die_with_owner(0.1, kill_after_s=5); time.sleep(600)"
)
CORE = {
    "mp": "import subprocess, sys, time; "
    + f"subprocess.Popen([sys.executable, '-c', {WORKER!r}]); time.sleep(600)",
    "uni": WORKER,
}


def owner(executor: str) -> str:
    return (
        "import subprocess, sys, time; from services.rollout.lifetime import mark_owner; mark_owner(); "
        f"subprocess.Popen([sys.executable, '-c', {CORE[executor]!r}]); time.sleep(600)"
    )


@pytest.mark.parametrize(("executor", "processes"), [("mp", 2), ("uni", 1)])
def test_the_engine_processes_stop_when_their_rollout_is_killed(executor: str, processes: int) -> None:
    parent = subprocess.Popen([sys.executable, "-c", owner(executor)], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(psutil.Process(parent.pid).children(recursive=True)) < processes:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine = psutil.Process(parent.pid).children(recursive=True)
        time.sleep(1.5)  # the worker has imported the module and started watching
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        killed_at = time.monotonic()
        _, alive = psutil.wait_procs(engine, timeout=10)
        assert not alive, "engine processes outlived their rollout"
        assert time.monotonic() - killed_at < 5
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
