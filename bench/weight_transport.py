"""Weight-transport benchmark: every implemented transport against grpc_stream, measured in the same run.

A real Learner service (in-process gRPC server on 127.0.0.1:0) publishes the weights of a random
Qwen2 model of the chosen size; the rollout's real staging code (`services.rollout.weight_sync`,
which calls each transport's rollout half in `services/transports/`) fetches and checksum-verifies
them. Reports prepare (learner snapshot + SHA-256) and stage (fetch + verify) times and bandwidth,
and the ratio of each transport to the grpc_stream baseline.
Loading into an engine is not included (it does not depend on the transport).

    .venv/bin/python bench/weight_transport.py --hidden 512 --layers 8 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.clients import open_channel
from services.common.serve import start_server
from services.learner.config import LearnerSettings
from services.learner.server import LearnerApp
from services.rollout.weight_sync import WeightStager
from services.transports.registry import TRANSPORTS, kind_to_proto, target_from_proto

# Every implemented transport (grpc_stream first: the baseline the others are compared with).
KINDS = {kind.value: kind_to_proto(kind) for kind in TRANSPORTS}


def build_model(directory: Path, hidden: int, layers: int, vocab: int) -> int:
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


async def measure(model_dir: Path, repeats: int) -> dict[str, dict[str, list[float]]]:
    settings = LearnerSettings(model=str(model_dir), device="cpu", dtype="float32", port=0)
    app = LearnerApp(settings)
    running = await start_server(app, settings)
    channel = open_channel(running.address)
    learner = learner_pb2_grpc.LearnerServiceStub(channel)
    results: dict[str, dict[str, list[float]]] = {
        k: {"prepare_ms": [], "stage_ms": [], "bytes": []} for k in KINDS
    }
    try:
        for _ in range(repeats):
            for name, kind in KINDS.items():
                t0 = time.perf_counter()
                prepared = await learner.PrepareWeights(
                    learner_pb2.PrepareWeightsRequest(transport=kind), timeout=600
                )
                t1 = time.perf_counter()
                stager = WeightStager("bench", fetch_timeout_s=600)
                staged = await stager.stage(target_from_proto(prepared.weight_version), current_version=-1)
                t2 = time.perf_counter()
                stager.close()
                del staged
                await learner.ReleaseWeights(
                    learner_pb2.ReleaseWeightsRequest(version=prepared.weight_version.version), timeout=60
                )
                results[name]["prepare_ms"].append((t1 - t0) * 1e3)
                results[name]["stage_ms"].append((t2 - t1) * 1e3)
                results[name]["bytes"].append(prepared.weight_version.total_bytes)
    finally:
        await channel.close()
        await running.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        params = build_model(Path(tmp), args.hidden, args.layers, args.vocab)
        results = asyncio.run(measure(Path(tmp), args.repeats))
    base = statistics.median(results["grpc_stream"]["stage_ms"])
    print(
        f"model: {params / 1e6:.1f}M params, {results['grpc_stream']['bytes'][0] / 2**20:.0f} MiB fp32; "
        f"median of {args.repeats}"
    )
    print(f"{'transport':<15}{'prepare ms':>12}{'stage ms':>12}{'stage GiB/s':>13}{'stage vs grpc':>15}")
    for name, r in results.items():
        stage = statistics.median(r["stage_ms"])
        gibps = r["bytes"][0] / 2**30 / (stage / 1e3)
        prepare = statistics.median(r["prepare_ms"])
        print(f"{name:<15}{prepare:>12.1f}{stage:>12.1f}{gibps:>13.2f}{base / stage:>14.2f}x")


if __name__ == "__main__":
    main()
