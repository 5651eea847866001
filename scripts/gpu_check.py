"""GPU checks in one command (`make gpu-check`) on a machine with one NVIDIA GPU; prints one report.

    1. the GPU-only tests (`pytest -m gpu`): wsum64 on the device, cuda_ipc export/attach/views
    2. cuda_ipc between two processes on one GPU, for bf16 and fp32: a real learner service and a
       transformers-engine rollout service, a Qwen2.5-0.5B-shaped random model built from its config
       (no downloads), `--syncs` versions of TrainStep → PrepareWeights → StageWeights → CommitWeights
       → alignment probe → ReleaseWeights: sync time per version, alignment (fp32 must be ≤ 1e-4),
       GPU memory per process after each sync (a leak shows as growth over the second half), and
       zero-copy attach (the rollout's own memory drops by about the model's size once it adopts the
       learner's buffer: it holds no second copy); for each learner of `--learners`: plain (one
       process), fsdp (one FSDP2 rank under torchrun, `distributed.shard_one_rank`) and fsdp-offload
       (the same with `distributed.cpu_offload`; fp32 only), whose losses and gradient norms are
       compared with the plain learner's (`same_training`)
    3. the weight-transport benchmark on the GPU (`bench/weight_transport.py --device cuda`, with
       Qwen2.5-0.5B's width, depth and vocabulary): every transport against grpc_stream and its
       medium's copy (cuda_ipc against a device-to-device copy; nccl from GPU 0 to GPU 1 where there
       are two, else skipped)
    4. grpo-mesh end to end against TRL on the GPU (`bench/vs_trl.py --shape qwen2.5-0.5b --device cuda
       --engine transformers --transport cuda_ipc`, 128-token completions, `--e2e-steps` steps, one
       round; fp32): optimizer steps/s of both and their ratio (TRL and its datasets travel as wheels:
       `make gpu-wheels`)

The report goes to stdout and, where $OUT is set (the device tool), to $OUT/gpu_check.json.

    python scripts/gpu_check.py [--syncs 100] [--dtypes bfloat16 float32] [--learners plain fsdp]
                                [--no-transport-bench] [--e2e-steps 10]
    python scripts/gpu_check.py --cpu-rehearsal   # the same two-process flow on CPU, over
                                                  # shared_memory with a small model: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from grpo.common.v1 import types_pb2  # noqa: E402
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc  # noqa: E402
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from services.launch.tiny_model import QWEN2_5_0_5B  # noqa: E402


def gpu_memory_mib() -> dict[int, int]:
    """pid → MiB of GPU memory used, from nvidia-smi (what the driver sees: every process)."""
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    usage = {}
    for line in out.strip().splitlines():
        pid, used = (part.strip() for part in line.split(","))
        usage[int(pid)] = int(used)
    return usage


REHEARSAL_SHAPE = {  # the same architecture, small enough for a CPU rehearsal
    **QWEN2_5_0_5B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "max_position_embeddings": 1024,
}  # fmt: skip

# Token ids of the TrainStep batches stay below this: the vocabulary of the tokenizer saved with every
# model here (build_tokenizer's default vocab_size, services/launch/tiny_model.py), smaller than
# either shape's vocab_size, so every id is one the model and its tokenizer both know.
TOKENIZER_VOCAB = 384


def build_model(directory: Path, shape: dict = QWEN2_5_0_5B) -> int:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.launch.tiny_model import build_tokenizer

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, torch_dtype="float32"))
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer().save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def child_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (which the device tool sets to the
    carried wheels' folder): the services and benchmarks import `grpo` and `services` from here."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


def start(args: list[str], port_file: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", *args, "--port", "0", "--port-file", str(port_file)]
    with log.open("w") as handle:
        return subprocess.Popen(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=child_env())


def wait_port(proc: subprocess.Popen, port_file: Path, log: Path, timeout: float = 900) -> str:
    deadline = time.monotonic() + timeout
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{port_file.stem} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return f"127.0.0.1:{port_file.read_text().strip()}"


def batch(step: int, vocab: int) -> types_pb2.TrainBatch:
    out = types_pb2.TrainBatch(batch_id=f"gpu-check-{step}", step=step)
    for g in range(2):
        group = out.groups.add(group_id=f"g{g}")
        for i in range(2):
            group.completions.add(
                prompt_token_ids=[(7 * g + j) % vocab for j in range(16)],
                completion_token_ids=[(3 * i + j + step) % vocab for j in range(16)],
                logprobs=[-5.0] * 16,
                sampling_params=types_pb2.SamplingParams(temperature=1.0, n=2),
            )
        group.rewards.extend([1.0, 0.0])
        group.advantages.extend([1.0, -1.0])
    return out


# How the learner runs: one process as usual; one FSDP2 rank under torchrun (`--nproc-per-node 1`,
# `distributed.shard_one_rank`); the same with `distributed.cpu_offload` (shards, gradients and AdamW
# state in host memory).
LEARNERS = {
    "plain": [],
    "fsdp": ["--distributed.shard-one-rank"],
    "fsdp-offload": ["--distributed.shard-one-rank", "--distributed.cpu-offload"],
}
TORCHRUN = ["torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m"]


def process_tree(pid: int) -> set[int]:
    """`pid` and its descendants (torchrun's agent and its worker), from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [pid]
    while todo:
        tree.add(todo[-1])
        todo.extend(children.get(todo.pop(), []))
    return tree


def logged_medians(log: Path, fields: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Medians of numbers a service logged (its JSON lines): {name: (event, field)} → {name: median}."""
    seen: dict[str, list[float]] = {name: [] for name in fields}
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        for name, (event, field) in fields.items():
            if record.get("event") == event and isinstance(record.get(field), int | float):
                seen[name].append(float(record[field]))
    return {name: round(statistics.median(values), 2) for name, values in seen.items() if values}


def cuda_ipc_check(
    model_dir: Path, params: int, dtype: str, syncs: int, work: Path, device: str = "cuda",
    learner_kind: str = "plain",
) -> dict:  # fmt: skip
    """Learner + transformers rollout as two processes on one GPU, synced over cuda_ipc `syncs` times
    (`device="cpu"`: the rehearsal, over shared_memory); the learner as `LEARNERS[learner_kind]`."""
    model_mib = params * (2 if dtype == "bfloat16" else 4) / 2**20
    kind = types_pb2.WEIGHT_TRANSPORT_KIND_CUDA_IPC
    if device == "cpu":
        kind = types_pb2.WEIGHT_TRANSPORT_KIND_SHARED_MEMORY
    name = f"{learner_kind}-{dtype}"
    learner = start(
        [*(TORCHRUN if learner_kind != "plain" else []), "services.learner", "--model", str(model_dir),
         "--device", device, "--dtype", dtype, "--publish.export-dtype", dtype, "--optim.lr", "1e-6",
         *LEARNERS[learner_kind]],
        work / f"learner-{name}.port", work / f"learner-{name}.log",
    )  # fmt: skip
    rollout = start(
        ["services.rollout", "--model", str(model_dir), "--engine", "transformers", "--dtype", dtype,
         "--hf.device", device, "--max-model-len", "512", "--rollout-id", "gpu-check"],
        work / f"rollout-{name}.port", work / f"rollout-{name}.log",
    )  # fmt: skip
    try:
        learner_address = wait_port(learner, work / f"learner-{name}.port", work / f"learner-{name}.log")
        rollout_address = wait_port(rollout, work / f"rollout-{name}.port", work / f"rollout-{name}.log")
        learner_stub = learner_pb2_grpc.LearnerServiceStub(grpc.insecure_channel(learner_address))
        rollout_stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(rollout_address))
        probe = types_pb2.TokenSequence(
            prompt_token_ids=list(range(1, 17)), completion_token_ids=list(range(20, 36)), temperature=1.0
        )
        rollout_before_attach = gpu_memory_mib().get(rollout.pid, 0)
        times, diffs, memory_after_first, steps = [], [], {}, []
        learner_per_sync: list[int] = []  # the learner's GPU MiB after each sync
        rollout_per_sync: list[int] = []  # the rollout's
        learner_pids = process_tree(learner.pid)  # under torchrun the worker holds the GPU memory

        def learner_mib(usage: dict[int, int]) -> int | None:
            held = [mib for pid, mib in usage.items() if pid in learner_pids]
            return sum(held) if held else None

        for step in range(syncs):
            trained = learner_stub.TrainStep(
                learner_pb2.TrainStepRequest(batch=batch(step, TOKENIZER_VOCAB)), timeout=600
            ).result.metrics
            steps.append([trained["loss"], trained["grad_norm"]])
            started = time.perf_counter()
            prepared = learner_stub.PrepareWeights(
                learner_pb2.PrepareWeightsRequest(transport=kind),
                timeout=600,
            ).weight_version
            t_prepare = time.perf_counter()
            rollout_stub.StageWeights(rollout_pb2.StageWeightsRequest(weight_version=prepared), timeout=600)
            t_stage = time.perf_counter()
            rollout_stub.CommitWeights(
                rollout_pb2.CommitWeightsRequest(version=prepared.version), timeout=600
            )
            t_commit = time.perf_counter()
            ours = learner_stub.ScoreTokens(learner_pb2.ScoreTokensRequest(sequence=probe), timeout=600)
            theirs = rollout_stub.ScoreTokens(rollout_pb2.ScoreTokensRequest(sequence=probe), timeout=600)
            learner_stub.ReleaseWeights(
                learner_pb2.ReleaseWeightsRequest(version=prepared.version), timeout=600
            )
            diffs.append(max(abs(a - b) for a, b in zip(ours.logprobs, theirs.logprobs, strict=True)))
            times.append(
                ((t_prepare - started) * 1e3, (t_stage - t_prepare) * 1e3, (t_commit - t_stage) * 1e3)
            )
            usage = gpu_memory_mib()
            learner_per_sync.append(learner_mib(usage) or 0)
            rollout_per_sync.append(usage.get(rollout.pid, 0))
            if step == 0:
                memory_after_first = usage
        memory_after_all = gpu_memory_mib()
        totals = [sum(t) for t in times]
        result = {
            "learner": learner_kind,
            "dtype": dtype,
            "syncs": syncs,
            "model_mib": round(model_mib, 1),
            "sync_ms_median": round(statistics.median(totals), 2),
            "sync_ms_p90": round(sorted(totals)[int(0.9 * (len(totals) - 1))], 2),
            "prepare_ms_median": round(statistics.median(t[0] for t in times), 2),
            "stage_ms_median": round(statistics.median(t[1] for t in times), 2),
            "commit_ms_median": round(statistics.median(t[2] for t in times), 2),
            "logprob_abs_diff_max": max(diffs),
            "alignment_ok": dtype != "float32" or max(diffs) <= 1e-4,
            "learner_mib_after_first_sync": learner_mib(memory_after_first),
            "learner_mib_after_all_syncs": learner_mib(memory_after_all),
            "loss_grad_norm_per_step": steps,
            "learner_mib_per_sync": learner_per_sync,
            "rollout_mib_per_sync": rollout_per_sync,
            "rollout_mib_before_attach": rollout_before_attach,
            "rollout_mib_after_first_sync": memory_after_first.get(rollout.pid),
            "rollout_mib_after_all_syncs": memory_after_all.get(rollout.pid),
        }
        # the learner's second staging buffer appears at the second sync (double buffering) and the
        # caching allocators settle within the first few syncs (a sharded bf16 learner at the third:
        # H200, 2026-11-27): growth counts over the second half; a leak grows with every sync
        growth = [per_sync[-1] - per_sync[syncs // 2] for per_sync in (learner_per_sync, rollout_per_sync)]
        result["memory_growth_second_half_mib"] = growth
        result["no_leak"] = all(g <= 64 for g in growth)
        # a rollout that kept its own copy would not shrink; adopting the learner's buffer frees the
        # model's memory in the rollout (less what its allocator keeps cached for activations)
        after = memory_after_all.get(rollout.pid) or rollout_before_attach
        result["rollout_freed_mib"] = rollout_before_attach - after
        # inside the services, per sync (medians): where the phases above spend their time
        result["logged_ms"] = {
            **logged_medians(work / f"learner-{name}.log", {"learner_prepare": ("weights prepared", "ms")}),
            **logged_medians(
                work / f"rollout-{name}.log",
                {
                    "rollout_stage": ("weights staged", "fetch_ms"),
                    "rollout_load": ("weights committed", "load_ms"),
                    "rollout_pause": ("weights committed", "pause_ms"),
                },
            ),
        }
        result["zero_copy_attach"] = rollout_before_attach - after >= 0.5 * model_mib
        return result
    finally:
        for proc in (rollout, learner):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def end_to_end(steps: int) -> dict:
    """bench/vs_trl.py on the GPU with Qwen2.5-0.5B's shape: its summary table, or why it failed."""
    run = subprocess.run(
        [sys.executable, "bench/vs_trl.py", "--shape", "qwen2.5-0.5b", "--device", "cuda", "--engine",
         "transformers", "--transport", "cuda_ipc", "--max-tokens", "128", "--steps", str(steps),
         "--skip", str(min(3, steps - 2)), "--repeats", "1"],
        cwd=ROOT, capture_output=True, text=True, check=False, timeout=900, env=child_env(),
    )  # fmt: skip
    lines = [line for line in run.stdout.strip().splitlines() if line.strip()]
    return {"exit_code": run.returncode, "table": lines[-6:] if run.returncode == 0 else run.stderr[-3000:]}


def rehearse(learners: list[str]) -> int:
    """The two-process flow on CPU: everything but CUDA (GPU memory reads as 0 without nvidia-smi)."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = build_model(work / "model", REHEARSAL_SHAPE)
        for learner in learners:
            results.append(cuda_ipc_check(work / "model", params, "float32", 3, work, "cpu", learner))
    report = {"cuda_ipc": results, "same_training": same_training(results)}
    print(json.dumps(report, indent=2))
    return 0 if all(r["alignment_ok"] for r in results) else 1


def same_training(results: list[dict]) -> dict:
    """Per dtype, the largest difference of any step's loss and gradient norm between each sharded
    learner and the plain one (the same batches from the same weights: equal up to rounding)."""
    plain = {r["dtype"]: r for r in results if r.get("learner") == "plain" and "error" not in r}
    out = {}
    for r in results:
        base = plain.get(r.get("dtype"))
        if r.get("learner") in (None, "plain") or "error" in r or base is None:
            continue
        pairs = zip(base["loss_grad_norm_per_step"], r["loss_grad_norm_per_step"], strict=True)
        diffs = [(abs(a[0] - b[0]), abs(a[1] - b[1])) for a, b in pairs]
        out[f"{r['learner']}-{r['dtype']}"] = {
            "loss_abs_diff_max": max(d[0] for d in diffs),
            "grad_norm_abs_diff_max": max(d[1] for d in diffs),
        }
    return out


def write(report: dict) -> None:
    """The report so far into $OUT (the device tool brings it back even if a later section hangs)."""
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(report, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--syncs", type=int, default=100)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument(
        "--learners", nargs="+", choices=list(LEARNERS), default=list(LEARNERS),
        help="How the learner runs in the cuda_ipc check (fsdp-offload: fp32 only).",
    )  # fmt: skip
    parser.add_argument(
        "--transport-bench",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Run the weight-transport benchmark (section 3).",
    )
    parser.add_argument(
        "--e2e-steps", type=int, default=10, help="Steps per side of the end-to-end benchmark (0: skip it)."
    )
    parser.add_argument(
        "--cpu-rehearsal",
        action="store_true",
        help="run the two-process flow on CPU (shared_memory, small model, 3 syncs) to check this script",
    )
    args = parser.parse_args()
    if args.cpu_rehearsal:
        return rehearse([kind for kind in args.learners if kind != "fsdp-offload"])  # offload: GPU only
    report: dict = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    if not torch.cuda.is_available():
        report["error"] = "no CUDA device"
        print(json.dumps(report, indent=2))
        return 1
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
         "tests/common/test_checksums.py", "tests/transports/test_cuda_ipc.py"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    report["gpu_tests"] = {"exit_code": tests.returncode, "summary": tests.stdout.strip().splitlines()[-1:]}
    if tests.returncode:
        report["gpu_tests"]["output"] = (tests.stdout + tests.stderr)[-6000:]
    write(report)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        params = build_model(work / "model")
        report["model_params_m"] = round(params / 1e6, 1)
        report["cuda_ipc"] = []
        for learner in args.learners:
            for dtype in args.dtypes:
                if learner == "fsdp-offload" and dtype != "float32":
                    continue
                try:
                    check = cuda_ipc_check(work / "model", params, dtype, args.syncs, work, "cuda", learner)
                except Exception as exc:  # one failing section must not hide the others
                    check = {
                        "learner": learner,
                        "dtype": dtype,
                        "error": f"{type(exc).__name__}: {exc}"[:4000],
                    }
                report["cuda_ipc"].append(check)
                report["same_training"] = same_training(report["cuda_ipc"])
                write(report)
    if args.transport_bench:
        bench = subprocess.run(
            [sys.executable, "bench/weight_transport.py", "--device", "cuda", "--repeats", "3",
             "--hidden", str(QWEN2_5_0_5B["hidden_size"]), "--layers", str(QWEN2_5_0_5B["num_hidden_layers"]),
             "--vocab", str(QWEN2_5_0_5B["vocab_size"])],
            cwd=ROOT, capture_output=True, text=True, check=False, timeout=900, env=child_env(),
        )  # fmt: skip
        lines = bench.stdout.strip().splitlines()
        start_at = next((i for i, line in enumerate(lines) if line.startswith("model:")), len(lines))
        report["benchmark"] = {
            "exit_code": bench.returncode,
            "table": lines[start_at:] or bench.stderr[-2000:],
        }
    write(report)
    if args.e2e_steps:
        report["e2e_vs_trl"] = end_to_end(args.e2e_steps)
    print(json.dumps(report, indent=2))
    write(report)
    ok = (
        report["gpu_tests"]["exit_code"] == 0
        and report.get("benchmark", {"exit_code": 0})["exit_code"] == 0
        and report.get("e2e_vs_trl", {"exit_code": 0})["exit_code"] == 0
        and all(
            r.get("alignment_ok") and r.get("no_leak") and r.get("zero_copy_attach")
            for r in report["cuda_ipc"]
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
