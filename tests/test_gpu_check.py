"""scripts/gpu_check.py (`make gpu-check`) rehearsed on CPU: the same two real processes (learner and
transformers-engine rollout services) and the same RPC sequence, over shared_memory with a small model,
for the plain learner and for one FSDP2 rank under torchrun, so the script that only runs where a GPU
is lent cannot rot unnoticed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_rehearses_its_two_process_flow_on_cpu() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--cpu-rehearsal"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{") :])
    assert [(r["learner"], r["syncs"]) for r in report["cuda_ipc"]] == [("plain", 3), ("fsdp", 3)]
    for run in report["cuda_ipc"]:
        assert run["logprob_abs_diff_max"] <= 1e-4  # fp32: learner and rollout agree after each sync
    # one FSDP2 rank under torchrun trains as the plain learner: the same loss and gradient norm
    sharded = report["same_training"]["fsdp-float32"]
    assert sharded["loss_abs_diff_max"] <= 1e-6 and sharded["grad_norm_abs_diff_max"] <= 1e-6
