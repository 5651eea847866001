"""Does a big TrainStep stall the learner's event loop? Health-check latency during a train step,
against the same probe on the idle learner, measured in one run.

A real learner process (`python -m services.learner`) gets one large TrainStep (many long
completions: decoding every token and logprob of the request is O(tokens) work). Meanwhile a client
sends `grpc.health.v1/Check` every 5 ms and records each answer's latency. If anything O(tokens) ran
on the event loop, the probes queue behind it and the worst latency grows with the batch; when the
loop only awaits the model thread, health stays at its idle latency.

    make demo   # builds .cache/tiny-model-warm120 on first use (any local model directory works)
    .venv/bin/python bench/learner_event_loop.py --model .cache/tiny-model-warm120 --groups 64 --tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common.clients import open_channel
from services.launch.processes import ServiceFailed, ServiceProcess

MAX_MESSAGE_BYTES = 256 << 20  # one large TrainStep request


def make_batch(vocab: int, groups: int, group_size: int, tokens: int) -> types_pb2.TrainBatch:
    batch = types_pb2.TrainBatch(batch_id="bench", step=0)
    for g in range(groups):
        group = batch.groups.add(group_id=f"g{g}")
        for i in range(group_size):
            group.completions.add(
                prompt_id=f"p{g}",
                index=i,
                prompt_token_ids=[(g + j) % vocab for j in range(16)],
                completion_token_ids=[(7 * i + j) % vocab for j in range(tokens)],
                logprobs=[-5.0] * tokens,
                sampling_params=types_pb2.SamplingParams(temperature=1.0, n=group_size),
            )
        group.rewards.extend([float(i % 2) for i in range(group_size)])
        group.advantages.extend([1.0 if i % 2 else -1.0 for i in range(group_size)])
    return batch


async def probe(stub: health_pb2_grpc.HealthStub, stop: asyncio.Event) -> list[float]:
    latencies = []
    request = health_pb2.HealthCheckRequest(service="")
    while not stop.is_set():
        started = time.perf_counter()
        await stub.Check(request, timeout=60)
        latencies.append((time.perf_counter() - started) * 1e3)
        await asyncio.sleep(0.005)
    return latencies


def summary(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "n": len(ordered),
        "p50_ms": statistics.median(ordered),
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_ms": ordered[-1],
    }


async def measure(
    learner_process: ServiceProcess, batch: types_pb2.TrainBatch, idle_s: float
) -> dict[str, dict[str, float]]:
    address = await learner_process.wait_ready(timeout=300)
    async with open_channel(address, MAX_MESSAGE_BYTES) as channel:
        health, learner = health_pb2_grpc.HealthStub(channel), learner_pb2_grpc.LearnerServiceStub(channel)
        stop = asyncio.Event()
        idle = asyncio.create_task(probe(health, stop))
        await asyncio.sleep(idle_s)
        stop.set()
        idle_latencies = await idle
        stop = asyncio.Event()
        busy = asyncio.create_task(probe(health, stop))
        started = time.perf_counter()
        response = await learner.TrainStep(learner_pb2.TrainStepRequest(batch=batch), timeout=600)
        train_s = time.perf_counter() - started
        stop.set()
        busy_latencies = await busy
        assert response.result.weight_version == 1
    return {
        "idle": summary(idle_latencies),
        "during_train_step": {**summary(busy_latencies), "train_step_s": train_s},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="model directory the learner loads")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="completion tokens per completion")
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    args = parser.parse_args()
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    batch = make_batch(vocab, args.groups, args.group_size, args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        learner = ServiceProcess(
            "learner",
            Path(tmp),
            args=["--model", args.model, "--device", "cpu", "--dtype", "float32",
                  "--max-message-bytes", str(MAX_MESSAGE_BYTES)],
        )  # fmt: skip
        learner.start()  # --port 0 --port-file; its log goes to <tmp>/logs/learner.log
        try:
            results = asyncio.run(measure(learner, batch, args.idle_seconds))
        except ServiceFailed as exc:
            raise SystemExit(f"the learner did not start: {exc}") from None
        finally:
            learner.terminate(grace=60)
    tokens = args.groups * args.group_size * args.tokens
    print(f"batch: {args.groups} groups x {args.group_size} completions x {args.tokens} tokens = {tokens}")
    idle, busy = results["idle"], results["during_train_step"]
    print(f"{'health Check':<22}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name, row in results.items():
        print(f"{name:<22}{row['n']:>6}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}{row['max_ms']:>10.2f}")
    print(f"train step: {busy['train_step_s']:.2f} s; worst health latency vs idle p50: "
          f"{busy['max_ms'] / max(idle['p50_ms'], 1e-6):.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
