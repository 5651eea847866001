"""Run by tests/learner/test_ranks.py, alone or under torchrun: the same training on 1 or N ranks.

For each case (objective × LoRA) rank 0 builds its trainer through `ranks.build` (announcing it), the
other ranks `follow`; two optimizer steps on a fixed batch, then an export. Rank 0 writes, per case,
the two steps' loss, gradient norm and per-token learner logprobs (gathered from every rank), and the
exported (gathered) weights to `<out>/<case>.safetensors` and `<out>/<case>.json`. The RESUMED cases
also checkpoint after their first step (in the background, as the learner does), into
`<out>/checkpoints/<case>`.

`--shard-one-rank`: alone, but sharded with FSDP2 all the same (a process group of one).

`--resume-from DIR`: only the RESUMED cases, each resumed from `DIR/checkpoints/<case>` (written at
another number of ranks), then its second step: `<out>/<case>-resumed.{json,safetensors}`.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.learner import ranks as ranked
from services.learner import sharding
from services.learner.batching import Sample
from services.learner.config import (
    CheckpointConfig,
    DistributedConfig,
    LearnerSettings,
    LoraConfig,
    LossConfig,
    OptimConfig,
)

CASES = [(loss, lora) for loss in ("grpo", "dapo", "gspo") for lora in (0, 4)]
RESUMED = [("dapo", 0), ("grpo", 4)]


def batch(seed: int) -> list[Sample]:
    """Eleven samples of different lengths (micro-batches and shares differ across ranks), temperatures
    1 and 0.7, one multi-turn sample with an environment span."""
    rng = random.Random(seed)
    samples = []
    for index in range(11):
        prompt = tuple(rng.randrange(64) for _ in range(rng.randint(1, 9)))
        completion = tuple(rng.randrange(64) for _ in range(rng.randint(2, 12)))
        behav = tuple(-4.16 + rng.uniform(-0.3, 0.3) for _ in completion)
        spans = ((1, 2),) if index == 3 else ()
        samples.append(
            Sample(prompt, completion, behav, rng.uniform(-1.5, 1.5), rng.choice([1.0, 0.7]), spans)
        )
    return samples


def settings(
    model: str, loss: str, lora: int, checkpoints: Path | None = None, resume: bool = False, one: bool = False
):
    adapters = LoraConfig(rank=lora, alpha=8, dropout=0.0, target_modules=("q_proj", "v_proj"))
    return LearnerSettings(
        model=model, device="cpu", micro_batch_tokens=48,
        loss=LossConfig(kind=loss), optim=OptimConfig(lr=1e-4),
        lora=adapters if lora else LoraConfig(),
        checkpoint=CheckpointConfig(dir=checkpoints, resume=resume),
        distributed=distributed(one),
    )  # fmt: skip


def distributed(shard_one_rank: bool) -> DistributedConfig:
    return DistributedConfig(timeout_s=60, idle_timeout_s=60, shard_one_rank=shard_one_rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resume-from", type=Path)
    parser.add_argument("--shard-one-rank", action="store_true", help="FSDP2 also when alone")
    args = parser.parse_args()
    resuming = args.resume_from is not None
    cases = []
    for loss, lora in RESUMED if resuming else CASES:
        name = f"{loss}-lora{lora}"
        if resuming:
            checkpoints, resume = args.resume_from / "checkpoints" / name, True
        else:
            checkpoints, resume = args.out / "checkpoints" / name if (loss, lora) in RESUMED else None, False
        config = settings(args.model, loss, lora, checkpoints, resume, args.shard_one_rank)
        cases.append((name, config))
    ranks = sharding.join(torch.device("cpu"), distributed(args.shard_one_rank))
    if ranks is not None and not ranks.leader:
        for _, config in cases:  # one `follow` per case: rank 0 says stop after each
            ranked.follow(config, ranks)
        sharding.leave()
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name, config in cases:
        trainer = ranked.build(config, ranks)
        steps = []
        for step in (1,) if resuming else (0, 1):
            outcome = trainer.train_step(batch(step), f"b{step}")
            figures = {k: outcome.metrics[k] for k in ("loss", "grad_norm", "num_tokens", "micro_batches")}
            steps.append({**figures, "logprobs": [lp.tolist() for lp in outcome.logprobs]})
            if step == 0 and config.checkpoint.dir is not None:
                trainer.save_checkpoint(background=True)  # as the learner does: written behind step 1
        weights = trainer.export()
        trainer.close()
        if ranks is not None:
            trainer.stop()
        out = f"{name}-resumed" if resuming else name
        save_file({k: v.contiguous() for k, v in weights.items()}, args.out / f"{out}.safetensors")
        (args.out / f"{out}.json").write_text(json.dumps(steps))
    sharding.leave()


if __name__ == "__main__":
    main()
