"""How many bytes a sparse delta saves per weight version: real optimizer steps, bf16 (or fp16) export.

A learner's `Trainer` (full fine-tune, AdamW at `--lr`) trains `--steps` steps on batches of the
`bench/profile_learner.py` shape (random ids and advantages, a new batch each step). After each step
the weights are exported in the rollout dtype and packed into buckets exactly as a weight version is
(`services/common/weights.py`). Each bucket is then encoded against the previous version's
(`services/common/weight_delta.py`), applied to a copy of that previous bucket, and the result must
match the new version's checksum: reconstructed bit for bit, or the run fails.

Printed per version: the whole payload, the delta's bytes and their ratio, the share of words that
changed, the encodings chosen, and the time to encode and to apply every bucket (one thread each).

    .venv/bin/python bench/weight_delta.py --model .cache/smollm2-135m-instruct-q4_1-fp32 --steps 20
    .venv/bin/python bench/weight_delta.py --model .cache/tiny-model-random --steps 3     # a smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.profile_learner import batch
from services.common import checksums, weights
from services.common.weight_delta import apply, encode
from services.learner.config import LearnerSettings, OptimConfig, PublishConfig
from services.learner.trainer import Trainer


def pack(state: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[bytearray, weights.Manifest]:
    buffer = bytearray(weights.packed_size(weights.plan_layout(state)))
    return buffer, weights.build_manifest(state, memoryview(buffer), bucket_bytes)


def delta_version(
    base: bytearray, new: bytearray, manifest: weights.Manifest, word: int
) -> dict[str, float | Counter]:
    """Every bucket of `new` as a delta against `base`, applied and checked against `manifest`."""
    payload = changed = 0
    encodings: Counter = Counter()
    encode_s = apply_s = 0.0
    for bucket in manifest.buckets:
        lo, hi = bucket.offset, bucket.offset + bucket.nbytes
        started = time.perf_counter()
        delta = encode(memoryview(base)[lo:hi], memoryview(new)[lo:hi], word)
        encode_s += time.perf_counter() - started
        target = bytearray(memoryview(base)[lo:hi])  # the receiver's copy of the base bucket
        started = time.perf_counter()
        apply(target, delta, word)
        apply_s += time.perf_counter() - started
        weights.check_digest(manifest, bucket, checksums.digest(manifest.algorithm, memoryview(target)))
        payload += len(delta.payload)
        changed += delta.changed
        encodings[delta.encoding.name] += 1
    return {
        "payload": payload,
        "changed": changed,
        "encodings": encodings,
        "encode_ms": encode_s * 1e3,
        "apply_ms": apply_s * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the model directory")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW's learning rate (the learner's default)")
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16", help="the rollout dtype")
    p.add_argument("--bucket-bytes", type=int, default=weights.DEFAULT_BUCKET_BYTES)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--completion-len", type=int, default=64)
    args = p.parse_args()

    settings = LearnerSettings(
        model=args.model,
        device="cpu",
        optim=OptimConfig(lr=args.lr),
        publish=PublishConfig(export_dtype=args.dtype),
    )
    trainer = Trainer(settings)
    word = torch.empty(0, dtype=weights.dtype_from_name(args.dtype)).element_size()
    previous, _ = pack(dict(trainer.export()), args.bucket_bytes)  # version 0: the model as loaded
    print(f"model: {args.model}, {len(previous) / 1e6:.1f} MB per version in {args.dtype}, lr {args.lr}")
    header = ("version", 7), ("whole MB", 9), ("delta MB", 9), ("ratio", 7), ("changed", 8), ("encode ms", 10)
    print(" ".join(f"{name:>{width}}" for name, width in header), f"{'apply ms':>9}  encodings")
    ratios = []
    for step in range(args.steps):
        samples = batch(trainer.vocab_size, args.prompts, args.group_size, 16, args.completion_len)
        samples = samples[step % len(samples) :] + samples[: step % len(samples)]  # a new batch each step
        trainer.train_step(samples, f"b{step}")
        current, manifest = pack(dict(trainer.export()), args.bucket_bytes)
        row = delta_version(previous, current, manifest, word)
        words = manifest.total_bytes // word
        ratios.append(row["payload"] / manifest.total_bytes)
        encodings = ", ".join(f"{k} {v}" for k, v in sorted(row["encodings"].items()))
        print(
            f"{trainer.weight_version:>7} {manifest.total_bytes / 1e6:>9.1f} {row['payload'] / 1e6:>9.2f} "
            f"{ratios[-1]:>7.4f} {row['changed'] / words:>8.4f} {row['encode_ms']:>10.1f} "
            f"{row['apply_ms']:>9.1f}  {encodings}"
        )
        previous = current
    print(
        f"delta / whole over {args.steps} versions: median {statistics.median(ratios):.4f}, "
        f"max {max(ratios):.4f}; every version reconstructed bit for bit (bucket checksums)"
    )


if __name__ == "__main__":
    main()
