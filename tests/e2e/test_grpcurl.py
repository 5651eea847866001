"""What a user sees with grpcurl: all four services started as processes (`python -m services.<svc>`)
list and describe themselves through reflection, report SERVING on grpc.health.v1, and answer a
malformed request with InvalidArgument while they keep serving. Uses the transformers rollout engine
(the vLLM path is covered by test_e2e_vllm.py) and the real grpcurl binary."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.launch.processes import READINESS, ServiceProcess

GRPCURL = shutil.which("grpcurl", path=str(Path(sys.executable).parent)) or shutil.which("grpcurl")
pytestmark = pytest.mark.skipif(GRPCURL is None, reason="grpcurl not installed (make install provides it)")

MALFORMED = {
    "env": ("SamplePrompts", {"n": 0, "split": "SPLIT_TRAIN"}),
    "learner": ("TrainStep", {"batch": {"batch_id": "b", "step": 0}}),
    "rollout": (
        "Generate",
        {"request_id": "r", "sampling_params": {"n": 1, "temperature": 1, "max_tokens": 2}},
    ),
    "scheduler": ("RegisterWorker", {"kind": "WORKER_KIND_ROLLOUT", "address": "no-port"}),
}


def grpcurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [GRPCURL, "-plaintext", "-max-time", "60", *args],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


@pytest.fixture
def cluster(tmp_path: Path, tiny_model_dir: Path):
    model = str(tiny_model_dir)
    procs = {
        "env": ServiceProcess("env", tmp_path),
        "learner": ServiceProcess(
            "learner", tmp_path, ["--model", model, "--device", "cpu", "--dtype", "float32"]
        ),
        "rollout": ServiceProcess(
            "rollout", tmp_path, ["--model", model, "--engine", "transformers", "--hf.num-threads", "1"]
        ),
    }
    for proc in procs.values():
        proc.start()
    try:
        yield procs
    finally:
        for proc in reversed(list(procs.values())):
            assert proc.terminate() == 0, f"{proc.name} did not stop cleanly:\n{proc.log_tail()}"


async def test_every_service_is_inspectable(cluster: dict[str, ServiceProcess], tmp_path: Path) -> None:
    addresses = dict(
        zip(cluster, await asyncio.gather(*(p.wait_ready(300) for p in cluster.values())), strict=True)
    )
    scheduler = ServiceProcess(
        "scheduler",
        tmp_path,
        ["--no-autostart"],
        env={
            "GRPO_SCHEDULER__ENV_ADDRESS": addresses["env"],
            "GRPO_SCHEDULER__LEARNER_ADDRESS": addresses["learner"],
            "GRPO_SCHEDULER__ROLLOUT_ADDRESSES": json.dumps([addresses["rollout"]]),
        },
    )
    scheduler.start()
    try:
        addresses["scheduler"] = await scheduler.wait_ready(120)
        for name, address in addresses.items():
            service = READINESS[name]
            listed = grpcurl(address, "list")
            assert listed.returncode == 0, listed.stderr
            assert {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
                listed.stdout.split()
            )
            described = grpcurl(address, "describe", service)
            assert described.returncode == 0 and f"service {service.rsplit('.', 1)[1]}" in described.stdout

            for probe in ("", service):
                health = grpcurl("-d", json.dumps({"service": probe}), address, "grpc.health.v1.Health/Check")
                assert json.loads(health.stdout)["status"] == "SERVING", (name, probe, health.stderr)

            method, body = MALFORMED[name]
            bad = grpcurl("-d", json.dumps(body), address, f"{service}/{method}")
            assert bad.returncode != 0 and "Code: InvalidArgument" in bad.stderr, (
                name,
                bad.stdout,
                bad.stderr,
            )
            again = grpcurl("-d", json.dumps({"service": service}), address, "grpc.health.v1.Health/Check")
            assert json.loads(again.stdout)["status"] == "SERVING"
    finally:
        assert scheduler.terminate() == 0, scheduler.log_tail()
