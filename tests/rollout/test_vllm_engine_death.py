"""A rollout whose vLLM engine core died does not linger as READY: it exits 1 (its supervisor then
starts a fresh one), whether a call notices the death or its watch on the engine does; a call sent as
the core dies gets an error, never an answer that does not come. The engine core is a real child
process here, killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 420.0


def test_a_rollout_whose_engine_core_died_exits_1(tiny_model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    port_file, log_path = tmp_path / "port", tmp_path / "server.log"
    command = [
        sys.executable, "-m", "services.rollout", "--engine", "vllm", "--model", str(tiny_model_dir),
        "--dtype", "float32", "--vllm.kv-cache-space-gib", "1", "--rollout-id", "vllm-death",
        "--port", "0", "--port-file", str(port_file), "--grace-seconds", "1",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        started = time.monotonic()
        while not (port_file.exists() and port_file.read_text().strip()):
            assert process.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() - started < START_TIMEOUT, "the rollout did not start"
            time.sleep(0.5)
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "vLLM's engine core should be a child process"
        for child in children:  # the engine core (and anything it started): SIGKILL, by pid
            child.kill()
        channel = grpc.insecure_channel(f"127.0.0.1:{port_file.read_text().strip()}")
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        request = rollout_pb2.GenerateRequest(
            request_id="after-death",
            prompt=types_pb2.Prompt(id="p", text="1+2="),
            sampling_params=types_pb2.SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=4),
        )
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(request, timeout=60))
        channel.close()
        assert process.wait(timeout=60) == 1, log_path.read_text()[-4000:]
        assert "engine unusable: stopping the rollout" in log_path.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
