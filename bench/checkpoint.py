"""What a periodic learner checkpoint costs the train step: inline vs in the background, against the
same steps without checkpoints, measured in one run.

A `Trainer` (the learner's training object, no service around it) trains `--steps` optimizer steps
on random completions three times: with no checkpoint directory (the baseline), with a checkpoint
after every step written inside the step (`--no-checkpoint.background`), and with one written by
the background writer (the default: the step only takes host copies). Printed: the median train step
of each and its ratio to the baseline; for the background mode also how long the write itself took
(waited for between steps here, so each step starts with the writer idle, as it does when
`checkpoint.every` steps take longer than one write).

    .venv/bin/python bench/checkpoint.py --model .cache/bench-qwen2-h512-l10
    make demo MODEL=smollm2   # converts SmolLM2-135M once into .cache/smollm2-135m-instruct-q4_1-fp32
    .venv/bin/python bench/checkpoint.py --model .cache/smollm2-135m-instruct-q4_1-fp32
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.learner.batching import Sample  # noqa: E402
from services.learner.config import CheckpointConfig, LearnerSettings  # noqa: E402
from services.learner.trainer import Trainer  # noqa: E402


def samples(n: int, vocab: int, seed: int, tokens: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = tuple(rng.randrange(vocab) for _ in range(16))
        completion = tuple(rng.randrange(vocab) for _ in range(tokens))
        behav = tuple(-5.0 + rng.uniform(-0.3, 0.3) for _ in completion)
        out.append(Sample(prompt, completion, behav, rng.uniform(-1.5, 1.5)))
    return out


def measure(args: argparse.Namespace, mode: str, work: Path) -> dict:
    checkpoint = CheckpointConfig()
    if mode != "none":
        checkpoint = CheckpointConfig(dir=work / mode, every=1, background=mode == "background")
    trainer = Trainer(LearnerSettings(model=str(args.model), device=args.device, checkpoint=checkpoint))
    steps, writes = [], []
    for i in range(args.steps + 1):  # the first step (allocations, warm-up) is left out
        batch = samples(args.samples, trainer.vocab_size, seed=i, tokens=args.tokens)
        started = time.perf_counter()
        trainer.train_step(batch, f"b{i}")
        steps.append(time.perf_counter() - started)
        if mode == "background":
            started = time.perf_counter()
            trainer.writer.wait()
            writes.append(time.perf_counter() - started)
    return {"step_ms": statistics.median(steps[1:]) * 1e3, "write_ms": statistics.median(writes[1:]) * 1e3
            if writes else float("nan")}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True, help="A local model directory.")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=4, help="Timed steps per mode (after one warm-up).")
    parser.add_argument("--samples", type=int, default=8, help="Completions per step.")
    parser.add_argument("--tokens", type=int, default=16, help="Tokens per completion.")
    args = parser.parse_args()
    (REPO / ".cache").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=REPO / ".cache") as tmp:  # on disk, as checkpoints are (not /tmp)
        results = {mode: measure(args, mode, Path(tmp)) for mode in ("none", "inline", "background")}
    base = results["none"]["step_ms"]
    print(f"model {args.model.name} on {args.device}: median of {args.steps} train steps, checkpoint each")
    for mode, r in results.items():
        write = f", the write itself {r['write_ms']:.0f} ms" if mode == "background" else ""
        ratio = r["step_ms"] / base
        print(f"{mode:>10}: {r['step_ms']:8.1f} ms  {ratio:5.2f}× the step without checkpoints{write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
