"""Where a learner train step spends its time: the torch profiler over `Trainer.train_step`.

The batch is the shape `bench/vs_trl.py` trains on SmolLM2 (G = 8 completions × 4 prompts, 64-token
completions after a short chat prompt), built from random token ids with random advantages: the cost
of a step depends on shapes, not on the values. One step warms up, then `--steps` steps run under the
profiler. Printed: the step's wall time split into forward+backward (every micro-batch), gradient clip,
optimizer step; then the profiler's top operators by self CPU time.

    .venv/bin/python bench/profile_learner.py --model .cache/smollm2-135m-instruct-q4_1-fp32
    .venv/bin/python bench/profile_learner.py --model .cache/tiny-model-random --steps 1     # a smoke run
    .venv/bin/python bench/profile_learner.py --model DIR --trace runs/profile.json   # for ui.perfetto.dev
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.learner.batching import Sample
from services.learner.config import LearnerSettings
from services.learner.trainer import Trainer


def batch(vocab: int, prompts: int, group: int, prompt_len: int, completion_len: int) -> list[Sample]:
    """`prompts` × `group` samples of random ids, behaviour logprobs and group-centred advantages."""
    rng = random.Random(0)
    samples = []
    for _ in range(prompts):
        prompt = tuple(rng.randrange(vocab) for _ in range(prompt_len))
        rewards = [rng.random() for _ in range(group)]
        mean = sum(rewards) / group
        for reward in rewards:
            completion = tuple(rng.randrange(vocab) for _ in range(completion_len))
            behav = tuple(-rng.uniform(0.1, 5.0) for _ in range(completion_len))
            samples.append(Sample(prompt, completion, behav, reward - mean))
    return samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model directory")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=40, help="prompt tokens (a system line and a question)")
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--loss", default="grpo")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--micro-batch-tokens", type=int, default=0, help="0: the learner's default")
    p.add_argument("--steps", type=int, default=2, help="profiled steps (after one warm-up step)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--trace", type=Path, help="write a Chrome trace of the profiled steps here")
    args = p.parse_args()

    settings = LearnerSettings(
        model=args.model, device="cpu", dtype="float32", micro_batch_tokens=args.micro_batch_tokens,
        loss={"kind": args.loss}, optim={"lr": 1e-6}, lora={"rank": args.lora_rank},
    )  # fmt: skip
    trainer = Trainer(settings)
    samples = batch(trainer.vocab_size, args.prompts, args.group_size, args.prompt_len, args.completion_len)
    trainable = sum(p.numel() for p in trainer.params) / 1e6
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(samples)} samples of "
          f"{samples[0].length} tokens; {trainable:.1f}M trainable")  # fmt: skip
    trainer.train_step(samples, "warm-up")

    phases = {"forward+backward": 0.0, "clip": 0.0, "optimizer": 0.0}
    originals = (trainer.accumulate_gradients, torch.nn.utils.clip_grad_norm_, trainer.optimizer.step)

    def timed(name, fn):
        def run(*a, **k):
            started = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] += time.perf_counter() - started

        return run

    trainer.accumulate_gradients = timed("forward+backward", originals[0])
    torch.nn.utils.clip_grad_norm_ = timed("clip", originals[1])
    trainer.optimizer.step = timed("optimizer", originals[2])
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for step in range(args.steps):
            trainer.train_step(samples, f"profiled-{step}")
    wall = (time.perf_counter() - started) / args.steps
    print(f"\nstep: {wall:.3f} s (profiler on)")
    for name, seconds in phases.items():
        print(f"  {name:<17} {seconds / args.steps:7.3f} s  {100 * seconds / args.steps / wall:5.1f} %")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
        print(f"trace: {args.trace}")


if __name__ == "__main__":
    main()
