"""Where a learner train step spends its time: the torch profiler over `Trainer.train_step`.

The batch is the shape `bench/vs_trl.py` trains on SmolLM2 (G = 8 completions × 4 prompts, 64-token
completions after a short chat prompt), built from random token ids with random advantages: the cost
of a step depends on shapes, not on the values. One step warms up, then `--steps` steps run under the
profiler. Printed: the step's wall time split into forward+backward (every micro-batch), gradient clip,
optimizer step; then the profiler's top operators by self CPU time.

`--trl` runs TRL's training phase on the same batch instead, as `bench/vs_trl.py` configures its
`GRPOTrainer` (grpo loss, no KL, batch = G × prompts in one pass, AdamW, clip 1.0): its own
`compute_loss` (logprobs and entropies of the completion tokens, the loss), backward, gradient clip and
its optimizer step, so the two learners' steps compare on one machine, one batch, one profiler.

    .venv/bin/python bench/profile_learner.py --model .cache/smollm2-135m-instruct-q4_1-fp32
    .venv/bin/python bench/profile_learner.py --model .cache/tiny-model-random --steps 1     # a smoke run
    .venv/bin/python bench/profile_learner.py --model DIR --trace runs/profile.json   # for ui.perfetto.dev
    .venv/bin/python bench/profile_learner.py --model .cache/smollm2-135m-instruct-q4_1-fp32 --trl
    .venv/bin/python bench/profile_learner.py --model DIR --no-profiler --steps 3 --micro-batch-tokens 2048
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from contextlib import nullcontext
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
    p.add_argument(
        "--profiler",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-profiler: step times only",
    )
    p.add_argument(
        "--shared-prefix",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-shared-prefix: every row run whole (a group's prompt once per row)",
    )
    p.add_argument("--trl", action="store_true", help="profile TRL's GRPOTrainer on the same batch instead")
    args = p.parse_args()
    if args.trl:
        return profile_trl(args)

    settings = LearnerSettings(
        model=args.model, device="cpu", dtype="float32", micro_batch_tokens=args.micro_batch_tokens,
        loss={"kind": args.loss}, optim={"lr": 1e-6}, lora={"rank": args.lora_rank},
        shared_prefix=args.shared_prefix,
    )  # fmt: skip
    trainer = Trainer(settings)
    samples = batch(trainer.vocab_size, args.prompts, args.group_size, args.prompt_len, args.completion_len)
    trainable = sum(p.numel() for p in trainer.params) / 1e6
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(samples)} samples of "
          f"{samples[0].length} tokens; {trainable:.1f}M trainable")  # fmt: skip
    trainer.train_step(samples, "warm-up")

    phases = dict.fromkeys(PHASES, 0.0)
    trainer.accumulate_gradients = timed(phases, "forward+backward", trainer.accumulate_gradients)
    torch.nn.utils.clip_grad_norm_ = timed(phases, "clip", torch.nn.utils.clip_grad_norm_)
    trainer.optimizer.step = timed(phases, "optimizer", trainer.optimizer.step)
    report(args, phases, lambda step: trainer.train_step(samples, f"profiled-{step}"))


PHASES = ("forward+backward", "clip", "optimizer")


def timed(phases: dict[str, float], name: str, fn):
    """`fn`, adding the seconds of each call to `phases[name]`."""

    def run(*a, **k):
        started = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases[name] += time.perf_counter() - started

    return run


def report(args: argparse.Namespace, phases: dict[str, float], step_once) -> None:
    """Run `step_once(step)` `--steps` times (under the profiler unless `--no-profiler`); print each
    step's time, the mean step, its phases and the top operators."""
    times = []
    with (
        profile(activities=[ProfilerActivity.CPU], record_shapes=False)
        if args.profiler
        else nullcontext() as prof
    ):
        for step in range(args.steps):
            started = time.perf_counter()
            step_once(step)
            times.append(time.perf_counter() - started)
    wall = sum(times) / args.steps
    each = " ".join(f"{t:.2f}" for t in times)
    print(f"\nstep: {wall:.3f} s (profiler {'on' if args.profiler else 'off'}; each: {each} s)")
    for name, seconds in phases.items():
        print(f"  {name:<17} {seconds / args.steps:7.3f} s  {100 * seconds / args.steps / wall:5.1f} %")
    if prof is None:
        return
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.trace:
        prof.export_chrome_trace(str(args.trace))
        print(f"trace: {args.trace}")


def profile_trl(args: argparse.Namespace) -> None:
    """TRL's training phase on `batch`'s samples: `GRPOTrainer.compute_loss`, backward, clip, AdamW."""
    with tempfile.TemporaryDirectory(prefix="profile-trl-") as output_dir:  # TRL's (empty: no saves)
        _profile_trl(args, output_dir)


def _profile_trl(args: argparse.Namespace, output_dir: str) -> None:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    n = args.prompts * args.group_size
    config = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=n,
        gradient_accumulation_steps=1, num_generations=args.group_size, num_iterations=1,
        max_completion_length=args.completion_len, beta=0.0, loss_type=args.loss, learning_rate=1e-6,
        max_grad_norm=1.0, optim="adamw_torch", use_cpu=True, report_to="none", save_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=args.model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_list([{"prompt": "1+1="}] * n),
    )  # fmt: skip
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1  # what `Trainer.train` sets before each step
    optimizer = trainer.create_optimizer()
    samples = batch(
        model.config.vocab_size, args.prompts, args.group_size, args.prompt_len, args.completion_len
    )
    inputs = {
        "prompt_ids": torch.tensor([s.prompt_ids for s in samples]),
        "completion_ids": torch.tensor([s.completion_ids for s in samples]),
        "advantages": torch.tensor([s.advantage for s in samples]),
        "num_items_in_batch": torch.tensor(float(n * args.completion_len)),
    }
    inputs["prompt_mask"] = torch.ones_like(inputs["prompt_ids"])
    inputs["completion_mask"] = torch.ones_like(inputs["completion_ids"])
    trainable = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; TRL's GRPOTrainer, {n} samples of "
          f"{samples[0].length} tokens; {trainable:.1f}M trainable")  # fmt: skip
    phases = dict.fromkeys(PHASES, 0.0)
    forward_backward = timed(
        phases, "forward+backward", lambda: trainer.compute_loss(model, inputs).backward()
    )
    clip = timed(phases, "clip", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimize = timed(phases, "optimizer", lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True)))

    def step_once(_: int) -> None:
        forward_backward()
        clip()
        optimize()

    step_once(-1)  # warm-up
    phases.update(dict.fromkeys(phases, 0.0))
    report(args, phases, step_once)


if __name__ == "__main__":
    main()
