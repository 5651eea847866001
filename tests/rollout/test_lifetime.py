"""The rollout's engine processes die with it: a rollout-like owner starts an engine-core-like child,
which starts a worker-like grandchild running `die_with_owner`; SIGKILL of the owner stops both."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

WORKER = (
    "from services.rollout.lifetime import die_with_owner; import time; "
    "die_with_owner(0.1, kill_after_s=5); time.sleep(600)"
)
CORE = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {WORKER!r}]); time.sleep(600)"
OWNER = (
    "import subprocess, sys, time; from services.rollout.lifetime import mark_owner; mark_owner(); "
    f"subprocess.Popen([sys.executable, '-c', {CORE!r}]); time.sleep(600)"
)


def test_the_engine_processes_stop_when_their_rollout_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", OWNER], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(psutil.Process(parent.pid).children(recursive=True)) < 2:
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
