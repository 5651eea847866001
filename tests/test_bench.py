"""The scheduler benchmark runs and reports what it claims to measure (never how fast: no timing
assertion). It drives the real `Orchestrator` against stub peers, in-process and over loopback gRPC,
so a change that breaks the scheduler's loop or its clients fails here as well as in its own tests."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_scheduler_benchmark_routes_every_completion_into_trained_batches() -> None:
    steps, warmup, groups, group_size = 12, 3, 4, 8
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scheduler.py"), "--rollouts", "1", "2", "--steps", str(steps),
         "--warmup-steps", str(warmup), "--groups-per-batch", str(groups), "--group-size", str(group_size),
         "--empty-calls", "50", "--mode", "both", "--repeats", "1", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    results = json.loads(out.stdout)["results"]
    assert sorted((r["mode"], r["rollouts"]) for r in results) == [
        ("inproc", 1), ("inproc", 2), ("loopback", 1), ("loopback", 2)
    ]  # fmt: skip
    for r in results:
        assert r["completions_routed"] == steps * groups * group_size, r  # after the warm-up steps
        assert r["groups_dropped"] == 0 and r["completions_per_s"] > 0
        assert 0 <= r["added_p50_ms"] <= r["added_p99_ms"] <= r["added_max_ms"]


def test_vs_trl_counts_generation_time_once_where_groups_overlap(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from vs_trl import generation_per_step

    def span(group: str, begin_s: float, end_s: float) -> list[dict]:
        common = {"name": "generate", "cat": "generate rollout-0", "id2": {"local": group}}
        return [{**common, "ph": "b", "ts": begin_s * 1e6}, {**common, "ph": "e", "ts": end_s * 1e6}]

    steps = [{"name": "train step", "ph": "X", "ts": (t - 0.5) * 1e6, "dur": 0.5e6} for t in (1, 3, 5)]
    # window: end of step 1 (t=1) to end of step 3 (t=5), two steps; generating 0–2 and 2.5–4.5 with
    # two groups overlapping in 3–4: busy 1 (1–2) + 2 (2.5–4.5) = 3 s, i.e. 1.5 s per step
    events = steps + span("a", 0, 2) + span("b", 2.5, 4) + span("c", 3, 4.5)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(events))
    assert generation_per_step(trace, 1) == 1.5
    assert math.isnan(generation_per_step(tmp_path / "missing.json", 1))  # run without --trace


def test_vs_trl_counts_the_cpu_of_every_process_under_the_launcher() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    from vs_trl import TreeCpu

    # the launched process only waits; its child spins for 0.3 s of CPU, then idles before exiting
    child = "import time\nwhile time.process_time() < 0.3: pass\ntime.sleep(1.0)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}], check=True)"
    process = subprocess.Popen([sys.executable, "-c", parent])
    with TreeCpu(process.pid, interval=0.05) as cpu:
        assert process.wait(timeout=60) == 0
    totals = [total for _, total in cpu.samples]
    assert totals == sorted(totals)  # an exited process keeps its last reading
    assert totals[-1] >= 0.3  # the grandchild's spin is counted (plus both interpreters' start-up)

    cpu.samples = [(10.0, 1.0), (12.0, 2.0), (14.0, 6.0)]
    assert cpu.at(11.0) == 1.5 and cpu.at(13.5) == 5.0
    assert cpu.at(9.0) == 1.0 and cpu.at(20.0) == 6.0  # clamped at the ends


def test_the_alignment_bench_splits_a_multi_turn_probe_and_measures_the_merge(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Real services (transformers engine) on the tiny model: both sides fp32 on the same weights agree
    on every part of the single- and the multi-turn sequence, and a LoRA adapter's merge is measured."""
    import torch
    from safetensors.torch import save_file

    from services.learner.config import LoraConfig
    from services.learner.model import load_policy

    policy = load_policy(str(tiny_model_dir), torch.device("cpu"), LoraConfig(rank=4))
    torch.manual_seed(0)
    adapter = {k: v + 0.05 * torch.randn_like(v) for k, v in policy.state_dict().items() if ".lora_" in k}
    save_file(adapter, tmp_path / "adapter.safetensors")  # as a learner checkpoint holds it
    out = tmp_path / "alignment.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "alignment.py"), "--model", str(tiny_model_dir),
         "--engine", "transformers", "--env", "guessing", "--tokens", "6", "--temperatures", "0.7",
         "--lora-checkpoint", str(tmp_path / "adapter.safetensors"), "--lora-rank", "4", "--json", str(out),
         "--work-dir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=True,
    )  # fmt: skip
    results = json.loads(out.read_text())
    assert set(results) == {"single T=0.7", "multi T=0.7"}
    multi = results["multi T=0.7"]
    assert set(multi["parts"]) == set(multi["merge"]) == {"model turn 1", "env turn", "model turn 2"}
    for row in results.values():
        assert row["completion_tokens"] > 0 and 0.0 <= row["max"] <= 1e-4, row
        assert all(0.0 <= v <= 1e-4 for v in row["merge"].values()), row
        assert row["rollout_self_spread"] == 0.0


def test_the_learner_profile_splits_a_step_into_its_phases(tiny_model_dir: Path) -> None:
    """bench/profile_learner.py on the tiny model: it trains a step under the profiler and reports each
    phase's share and the operators' table (what it says about speed is not checked)."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "profile_learner.py"), "--model", str(tiny_model_dir),
         "--steps", "1", "--top", "5", "--prompts", "2", "--group-size", "2", "--completion-len", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    for phase in ("forward+backward", "clip", "optimizer"):
        assert phase in run.stdout, run.stdout
    assert "4 samples of 48 tokens" in run.stdout and "aten::mm" in run.stdout, run.stdout


def test_the_learner_profile_runs_trls_training_phase_on_the_same_batch(tiny_model_dir: Path) -> None:
    """`--trl`: the same batch through TRL's GRPOTrainer loss, backward, clip and AdamW (TRL is the
    bench extra: skipped where it is not installed)."""
    pytest.importorskip("trl")
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "profile_learner.py"), "--model", str(tiny_model_dir), "--trl",
         "--steps", "1", "--top", "5", "--prompts", "2", "--group-size", "2", "--completion-len", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert "TRL's GRPOTrainer, 4 samples of 48 tokens" in run.stdout, run.stdout
    for phase in ("forward+backward", "clip", "optimizer"):
        assert phase in run.stdout, run.stdout


def test_the_delta_bench_reconstructs_every_version_bit_for_bit(tiny_model_dir: Path) -> None:
    """bench/weight_delta.py on the tiny model: two real optimizer steps, each version's buckets sent as
    deltas against the previous one and checked against the new checksums (the run fails otherwise);
    at the learner's default lr only a small share of the bf16 words change."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "weight_delta.py"), "--model", str(tiny_model_dir),
         "--steps", "2", "--prompts", "2", "--group-size", "2", "--completion-len", "8"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["1"], ["2"])]
    assert len(rows) == 2, run.stdout
    for row in rows:
        whole, delta = float(row[1]), float(row[2])
        assert 0 < delta < whole, run.stdout
    assert "reconstructed bit for bit" in run.stdout
