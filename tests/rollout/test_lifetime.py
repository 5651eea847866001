"""The rollout's engine processes die with it: `die_with_parent` in a child whose parent is SIGKILLed."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil

CHILD = (
    "from services.rollout.lifetime import die_with_parent; import time; "
    "die_with_parent(0.1); time.sleep(600)"
)
PARENT = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {CHILD!r}]); time.sleep(600)"


def test_a_child_watching_its_parent_dies_when_the_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not psutil.Process(parent.pid).children():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = psutil.Process(parent.pid).children()[0]
        time.sleep(1.0)  # the child has imported the module and started watching
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        killed_at = time.monotonic()
        gone, _ = psutil.wait_procs([child], timeout=10)
        assert gone, "the engine-like child outlived its parent"
        assert time.monotonic() - killed_at < 5
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
