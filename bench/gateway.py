"""What does the OpenAI-compatible gateway cost on top of the rollout's gRPC API? The same chat requests
through `/v1/chat/completions` (a real `python -m services.gateway` process, driven with aiohttp, or
httpx with `--client httpx`) and
straight through the rollout's gRPC `Generate` (driven with grpc.aio), measured in one run, against
one rollout process (vLLM when importable, else transformers; `--engine`).

Same requests on both sides: `--prompts` chat prompts (one user message each), `--n` samples,
`--max-tokens`, temperature `--temperature`, with `--seed S` prompt i sampled with seed S + i (both
sides then sample the same tokens and the engine does the same work: the bench reports the fraction
of identical completions; unseeded by default),
all `--concurrency` at a time. gRPC: one Generate per prompt with the messages (the rollout renders
them). Gateway: one POST per prompt with `logprobs` and `return_token_ids` (a first chat call: one
Generate with the messages, which the rollout renders). The client matters at this rate: httpx's
connection pool costs the bench process more CPU per request than the gateway spends (profiled with
py-spy: `AsyncConnectionPool._assign_requests_to_connections` checks every connection's socket on every
request), on the same 2 cores the rollout needs; aiohttp is the default. The model is the tiny model
with random weights (`.cache/tiny-model-random`, built on first use), which rarely samples EOS, so
completions run to --max-tokens on both sides.

Runs alternate (grpc, gateway, grpc, gateway, ... `--repeats` pairs, after one untimed warm-up of
each). Per run: completion tokens received / wall time from the first request sent to the last
answer parsed. The summary: median tokens/s per side and gateway/grpc per adjacent pair (median,
min, max). The issue's bar: gateway/grpc >= 0.9.

    B="flock /tmp/cpu.lock .venv/bin/python bench/gateway.py"
    $B                                   # 64 prompts x n=4, 32 tokens, 3 pairs
    $B --engine transformers --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import grpc  # noqa: E402
import httpx  # noqa: E402

from grpo.common.v1 import types_pb2  # noqa: E402
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from services.launch.processes import die_with  # noqa: E402
from services.rollout.rollout import vllm_available  # noqa: E402

PYTHON = sys.executable


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="model directory (default: the tiny random model)")
    parser.add_argument("--engine", choices=["auto", "vllm", "transformers"], default="auto")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="prompt i is sampled with seed + i on both sides (identical tokens); 0 = unseeded (vLLM's CPU "
        "build dies on seeded requests under load: 'CPU Generator does not use offset')",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed (grpc, gateway) pairs")
    parser.add_argument(
        "--client",
        choices=["aiohttp", "httpx"],
        default="aiohttp",
        help="the HTTP client of the gateway side",
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON line too")
    return parser.parse_args(argv)


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from services.launch.tiny_model import build_tiny_model

    return build_tiny_model(REPO / ".cache" / "tiny-model-random")


def start(argv: list[str], port_file: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as handle:  # the child gets SIGTERM when the bench dies (die_with)
        return subprocess.Popen([PYTHON, "-m", *argv, "--port-file", str(port_file)], cwd=REPO,
                                stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=die_with(os.getpid()))  # fmt: skip


async def wait_port(process: subprocess.Popen, port_file: Path, log: Path, timeout: float) -> int:  # noqa: ASYNC109
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(port_file.exists):
        if process.poll() is not None:
            tail = (await asyncio.to_thread(log.read_text))[-3000:]
            raise SystemExit(f"{process.args[2]} exited {process.returncode}:\n{tail}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{process.args[2]} did not start within {timeout:g}s")
        await asyncio.sleep(0.2)
    return int(await asyncio.to_thread(port_file.read_text))


def messages(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"What is {index} + {index * 7 % 13}? Answer briefly."}]


async def bounded(concurrency: int, jobs: list[Any]) -> list[Any]:
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Any) -> Any:
        async with gate:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs))


async def run_grpc(stub: Any, args: argparse.Namespace, tag: str) -> list[list[tuple[int, ...]]]:
    def job(index: int) -> Any:
        async def call() -> list[tuple[int, ...]]:
            request = rollout_pb2.GenerateRequest(
                request_id=f"{tag}-{index}",
                prompt=types_pb2.Prompt(
                    id=f"p{index}", messages=[types_pb2.ChatMessage(**m) for m in messages(index)]
                ),
                sampling_params=types_pb2.SamplingParams(
                    n=args.n,
                    temperature=args.temperature,
                    top_p=1.0,
                    max_tokens=args.max_tokens,
                    seed=seed(args, index),
                ),
            )
            completions = [c async for r in stub.Generate(request, timeout=600) for c in r.completions]
            return [tuple(c.completion_token_ids) for c in sorted(completions, key=lambda c: c.index)]

        return call

    return await bounded(args.concurrency, [job(i) for i in range(args.prompts)])


async def run_gateway(client: Any, args: argparse.Namespace) -> list[list[tuple[int, ...]]]:
    """The prompts through /v1/chat/completions with `client` (an aiohttp or httpx session)."""

    def job(index: int) -> Any:
        async def call() -> list[tuple[int, ...]]:
            body = {
                "messages": messages(index), "n": args.n, "max_tokens": args.max_tokens,
                "seed": seed(args, index), "temperature": args.temperature, "logprobs": True,
                "return_token_ids": True,
            }  # fmt: skip
            if isinstance(client, httpx.AsyncClient):
                reply = await client.post("/v1/chat/completions", json=body)
                reply.raise_for_status()
                answer = reply.json()
            else:
                async with client.post("/v1/chat/completions", json=body) as reply:
                    reply.raise_for_status()
                    answer = await reply.json()
            return [tuple(c["token_ids"]) for c in answer["choices"]]

        return call

    return await bounded(args.concurrency, [job(i) for i in range(args.prompts)])


def seed(args: argparse.Namespace, index: int) -> int:
    return args.seed + index if args.seed else 0


def tokens(results: list[list[tuple[int, ...]]]) -> int:
    return sum(len(c) for choices in results for c in choices)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    model = resolve_model(args)
    engine = args.engine if args.engine != "auto" else ("vllm" if vllm_available() else "transformers")
    run_dir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    max_len = 512
    # on a shared CPU host: a small KV cache, and no claim on most of the machine's memory
    vllm = ["--vllm.kv-cache-space-gib", "2", "--vllm.gpu-memory-utilization", "0.3"] * (engine == "vllm")
    rollout = start(
        ["services.rollout", "--model", str(model), "--engine", engine, "--dtype", "float32",
         "--max-model-len", str(max_len), "--rollout-id", "bench", "--max-in-flight", "512", *vllm],
        run_dir / "rollout.port", run_dir / "rollout.log",
    )  # fmt: skip
    processes = [rollout]
    try:
        port = await wait_port(
            rollout, run_dir / "rollout.port", run_dir / "rollout.log", args.startup_timeout
        )
        address = f"127.0.0.1:{port}"
        gateway = start(
            ["services.gateway", "--rollouts", address, "--admission.per-rollout-in-flight", "512",
             "--limits.max-n", str(max(args.n, 1)), "--log-level", "WARNING"],
            run_dir / "gateway.port", run_dir / "gateway.log",
        )  # fmt: skip
        processes.append(gateway)
        gport = await wait_port(
            gateway, run_dir / "gateway.port", run_dir / "gateway.log", args.startup_timeout
        )
        channel = grpc.aio.insecure_channel(address)
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        base = f"http://127.0.0.1:{gport}"
        async with contextlib.AsyncExitStack() as stack:
            if args.client == "httpx":
                limits = httpx.Limits(
                    max_connections=args.concurrency, max_keepalive_connections=args.concurrency
                )
                client: Any = await stack.enter_async_context(
                    httpx.AsyncClient(base_url=base, timeout=600, limits=limits)
                )
            else:
                client = await stack.enter_async_context(
                    aiohttp.ClientSession(
                        base, connector=aiohttp.TCPConnector(limit=args.concurrency),
                        timeout=aiohttp.ClientTimeout(total=600),
                    )
                )  # fmt: skip
            async with httpx.AsyncClient(base_url=base, timeout=30) as probe:
                while (await probe.get("/health")).status_code != 200:  # noqa: ASYNC110 (another process)
                    await asyncio.sleep(0.2)
            await run_grpc(stub, args, "warm")  # untimed warm-up of each side
            await run_gateway(client, args)
            runs: dict[str, list[float]] = {"grpc": [], "gateway": []}
            same = []
            for repeat in range(args.repeats):
                outputs = {}
                for side in ("grpc", "gateway") if repeat % 2 == 0 else ("gateway", "grpc"):
                    started = time.perf_counter()
                    if side == "grpc":
                        outputs[side] = await run_grpc(stub, args, f"r{repeat}")
                    else:
                        outputs[side] = await run_gateway(client, args)
                    elapsed = time.perf_counter() - started
                    runs[side].append(tokens(outputs[side]) / elapsed)
                    print(f"run {repeat} {side:8s} {tokens(outputs[side]):7d} tokens {elapsed:7.2f} s "
                          f"{runs[side][-1]:9.1f} tokens/s", flush=True)  # fmt: skip
                pairs = [(a, b) for x, y in zip(outputs["grpc"], outputs["gateway"], strict=True)
                         for a, b in zip(x, y, strict=True)]  # fmt: skip
                same.append(sum(a == b for a, b in pairs) / len(pairs))
        await channel.close()
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in reversed(processes):
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
    ratios = [g / r for g, r in zip(runs["gateway"], runs["grpc"], strict=True)]
    return {
        "engine": engine, "model": str(model), "prompts": args.prompts, "n": args.n,
        "max_tokens": args.max_tokens, "concurrency": args.concurrency, "repeats": args.repeats,
        "grpc_tokens_per_s": statistics.median(runs["grpc"]),
        "gateway_tokens_per_s": statistics.median(runs["gateway"]),
        "gateway_over_grpc": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "identical_completions": statistics.mean(same), "cpus": os.cpu_count(), "client": args.client,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = asyncio.run(bench(args))
    print(
        f"\n{summary['engine']}: {args.prompts} prompts x n={args.n}, {args.max_tokens} tokens, concurrency "
        f"{args.concurrency}, {args.repeats} pairs, {args.client} client\n"
        f"  grpc Generate         {summary['grpc_tokens_per_s']:9.1f} tokens/s (median)\n"
        f"  /v1/chat/completions  {summary['gateway_tokens_per_s']:9.1f} tokens/s (median)\n"
        f"  gateway/grpc          {summary['gateway_over_grpc']:.3f} [{summary['ratio_min']:.3f}, "
        f"{summary['ratio_max']:.3f}]  (bar: >= 0.9)"
    )
    if args.seed:  # unseeded, the two sides sample different tokens
        print(f"  identical completions {summary['identical_completions']:.1%}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
