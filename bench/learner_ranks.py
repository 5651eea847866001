"""A learner of N ranks (FSDP2 under torchrun) against one rank: memory per rank and step time.

For each count of ranks, the learner's trainer trains `--steps` steps (after one warm-up step) on the
batch `bench/profile_learner.py` uses (the shape `bench/vs_trl.py` trains SmolLM2 on), every rank
holding its shard of the parameters, gradients and AdamW state. Printed per count: each rank's resident
share of the trainable parameters, of their gradients and of AdamW's state (the tensors it holds), its
resident memory once the model is loaded and sharded, its peak until then (loading), its peak over the
run (ru_maxrss) and the growth between the loaded and the peak figure (gradients, optimizer state,
activations, FSDP's gathered layers), the mean step time; then the ratios to the first count, measured
in the same run.

    .venv/bin/python bench/learner_ranks.py --model .cache/smollm2-135m-instruct-q4_1-fp32 --ranks 1 2
    .venv/bin/python bench/learner_ranks.py --model .cache/tiny-model-random --ranks 1 2 --steps 1   # smoke

Each count runs in processes of its own (torchrun for N > 1), so their peaks are their own. A model is
loaded whole by every rank before it is sharded: the load peak is that moment.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_learner import batch
from services.common.malloc import set_mmap_threshold
from services.learner import sharding
from services.learner.config import DistributedConfig, LearnerSettings
from services.learner.trainer import Trainer


def _local_mb(tensor: torch.Tensor | None) -> float:
    """MB this rank holds of `tensor` (its shard for a sharded one)."""
    if tensor is None:
        return 0.0
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size() / 2**20


def held(trainer: Trainer) -> dict[str, float]:
    """MB of trainable parameters, their gradients (held between micro-batches: zeroed at the step's
    end, so measured by one accumulation) and AdamW's state this rank holds."""
    trainer.accumulate_gradients(batch(trainer.vocab_size, 1, 2, 8, 8))
    grads = sum(_local_mb(p.grad) for p in trainer.params)
    trainer.optimizer.zero_grad(set_to_none=True)
    states = trainer.optimizer.state.values()
    return {
        "params_mb": sum(_local_mb(p) for p in trainer.params),
        "grads_mb": grads,
        "adam_mb": sum(
            _local_mb(v) for state in states for v in state.values() if isinstance(v, torch.Tensor)
        ),
    }


def worker(args: argparse.Namespace) -> None:
    """One rank (or the only process): load, shard, train; write this rank's figures."""
    settings = LearnerSettings(
        model=args.model, device="cpu", dtype="float32", loss={"kind": "grpo"}, optim={"lr": 1e-6},
        lora={"rank": args.lora_rank}, malloc_mmap_threshold_bytes=args.mmap_threshold,
    )  # fmt: skip
    if threshold := settings.mmap_threshold(sharding.world_size()):
        set_mmap_threshold(threshold)  # as services/learner/server.py does, before the model is loaded
    ranks = sharding.join(torch.device("cpu"), DistributedConfig(timeout_s=600))
    trainer = Trainer(settings, ranks)
    loaded_mb = psutil.Process().memory_info().rss / 2**20
    load_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the most while loading
    samples = batch(trainer.vocab_size, 4, 8, 40, 64)
    trainer.train_step(samples, "warm-up")  # every rank, the same batch: each trains its share
    started = time.perf_counter()
    for step in range(args.steps):
        trainer.train_step(samples, f"step-{step}")
    step_s = (time.perf_counter() - started) / args.steps
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rank = ranks.rank if ranks else 0
    figures = {
        "rank": rank,
        "loaded_mb": loaded_mb,
        "load_peak_mb": load_peak_mb,
        "peak_mb": peak_mb,
        "step_s": step_s,
        **held(trainer),
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(figures))
    sharding.leave()


def measure(args: argparse.Namespace, count: int, out: Path) -> list[dict]:
    """Run `count` ranks; their figures, by rank."""
    me = [str(Path(__file__).resolve()), "--worker", "--model", args.model, "--out", str(out)]
    me += ["--steps", str(args.steps), "--lora-rank", str(args.lora_rank)]
    if args.mmap_threshold is not None:
        me += ["--mmap-threshold", str(args.mmap_threshold)]
    if count == 1:
        command = [sys.executable, *me]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={count}"]
        command += me
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, args.threads // count))}  # the same cores in all
    subprocess.run(command, check=True, timeout=args.timeout, env=env, stdout=subprocess.DEVNULL)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument(
        "--mmap-threshold",
        type=int,
        help="the learner's malloc_mmap_threshold_bytes (0: glibc's own; default: the learner's default)",
    )
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="split over the ranks")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    results = {}
    for count in args.ranks:
        with tempfile.TemporaryDirectory() as out:
            results[count] = measure(args, count, Path(out))
    base = args.ranks[0]
    print(f"{'ranks':>5} {'rank':>4} {'params MB':>9} {'grads MB':>8} {'adam MB':>8} {'loaded MB':>10} "
          f"{'load peak MB':>12} {'peak MB':>8} {'growth MB':>10} {'step s':>7}")  # fmt: skip
    for count, figures in results.items():
        for f in figures:
            growth = f["peak_mb"] - f["loaded_mb"]
            held_mb = f"{f['params_mb']:>9.0f} {f['grads_mb']:>8.0f} {f['adam_mb']:>8.0f}"
            rss = f"{f['loaded_mb']:>10.0f} {f['load_peak_mb']:>12.0f} {f['peak_mb']:>8.0f} {growth:>10.0f}"
            print(f"{count:>5} {f['rank']:>4} {held_mb} {rss} {f['step_s']:>7.2f}")
    for count, figures in results.items():
        if count == base:
            continue
        peak = max(f["peak_mb"] for f in figures) / max(f["peak_mb"] for f in results[base])
        growth = max(f["peak_mb"] - f["loaded_mb"] for f in figures) / max(
            f["peak_mb"] - f["loaded_mb"] for f in results[base]
        )
        step = max(f["step_s"] for f in figures) / max(f["step_s"] for f in results[base])
        state = max(f["params_mb"] + f["grads_mb"] + f["adam_mb"] for f in figures) / max(
            f["params_mb"] + f["grads_mb"] + f["adam_mb"] for f in results[base]
        )
        print(f"{count} ranks / {base}: parameters + gradients + AdamW state per rank ×{state:.2f}, "
              f"peak resident memory per rank ×{peak:.2f}, its growth ×{growth:.2f}, "
              f"step time ×{step:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
