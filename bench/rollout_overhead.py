"""What does the Rollout service cost on top of vLLM? The rollout service (a real
`python -m services.rollout --engine vllm` process, driven over gRPC from this process) against bare
vLLM `AsyncLLM` (in this process) on identical requests, measured in one run.

Same engine: the bare `AsyncLLM` is built by the service's own code (`VllmEngine.start()` with the
settings the service process parses from the same flags: model, dtype fp32, KV cache size,
max_num_seqs, prefix caching, processed logprobs, seed, worker extension), so only what the service
adds around the engine differs. Same requests: the demo's arithmetic prompts ("3+5="), `--prompts`
at once, `--batches` such sets one after the other; `--n` samples each, temperature
`--temperature`, `--max-tokens`, logprobs of the sampled tokens (`logprobs=0`: vLLM's processed
logprobs, as the service asks for them), seed `--seed` (sample i of a prompt: seed + i on both
sides; 0 = unseeded). The service tokenizes the prompt text itself (the bench checks it got the
same ids bare vLLM is given). Bare vLLM gets one request per prompt with all `n` samples and reads
the final outputs, with vLLM's cheapest logprob form (flat lists) and its text (vLLM's
detokenizer; `--no-bare-text`: no text, the engine-only floor); the service gets the prompts as the
scheduler sends its groups, through the scheduler's own rollout client (the prompts issued together
travel in one GenerateBatch call; `--calls per-prompt`: one Generate call each, as before), and
streams the completions back as Completion messages (tokens, logprobs, version spans, text), those
that finished in the same engine step in one response. With a seed
both sides sample the same tokens (the bench reports the fraction of identical completions), so the
engine does the same work.

Runs alternate (bare, service, bare, service, ... `--repeats` pairs, after one untimed warm-up of
each), with a pause between runs so that the idle engine's busy-wait has stopped.
`--profile-service FILE` records the rollout process with py-spy during the timed runs.

    make demo   # builds .cache/tiny-model-warm120 on first use (any local model directory works)
    B="flock /tmp/cpu.lock .venv/bin/python bench/rollout_overhead.py"
    $B                                                         # the demo's model: ~2.5 tokens each
    $B --model .cache/tiny-model-random --batches 1            # random weights: ~60 of 64 tokens
    $B --hidden 512 --layers 10 --batches 1 --max-tokens 32    # a random 29M Qwen2, built once

What each number means (per run; the summary gives median [min, max] over the timed runs):

    tokens/s          completion tokens received / wall time from the first request sent to the
                      last completion received (bare: RequestOutputs in this process; service:
                      Completion messages received by this process's gRPC client)
    completions/s     completions received / the same wall time
    service/bare      ratio of tokens/s (and completions/s) per adjacent (bare, service) pair;
                      1.0 = the service costs nothing on top of vLLM
    tok/compl         mean completion length (EOS ends a completion before --max-tokens)
    front-end CPU s   CPU seconds of the process that holds the AsyncLLM (bare: this process;
                      service: the rollout process) during the run
    engine CPU s      CPU seconds of the engine-core and worker processes of that side
    client CPU s      CPU seconds of this process during a service run (the gRPC client); on a
                      small machine it competes with the service and the engine for the same cores
    calls             Generate or GenerateBatch calls the service side made
    messages          stream messages the service sent (completions that finish in the same engine
                      step travel in one message, across all requests of a GenerateBatch call)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this tree's services (also from a git worktree), from anywhere

DEFAULT_MODEL = ROOT / ".cache" / "tiny-model-warm120"
MAX_MESSAGE_BYTES = 64 << 20


@dataclass
class Run:
    side: str  # "bare" | "service"
    repeat: int  # -1 = warm-up
    wall_s: float
    completions: int
    tokens: int
    frontend_cpu_s: float
    engine_cpu_s: float
    client_cpu_s: float
    calls: int  # service: Generate or GenerateBatch calls made (bare: 0)
    messages: int  # service: stream messages received (bare: 0)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def completions_per_s(self) -> float:
        return self.completions / self.wall_s

    def row(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "tokens_per_s": self.tokens_per_s,
            "completions_per_s": self.completions_per_s,
        }


def build_prompts(count: int, seed: int) -> list[str]:
    """`count` arithmetic prompts of the demo task ("3+5=")."""
    from services.env.builtins.arithmetic import ArithmeticOptions, make_problem
    from services.launch.tiny_model import DEMO_TASK

    rng, options = random.Random(seed), ArithmeticOptions(**DEMO_TASK)
    return [make_problem(rng, options)[0] for _ in range(count)]


def resolve_model(args: argparse.Namespace) -> Path:
    if args.hidden or args.layers:
        from services.launch.tiny_model import build_tiny_model

        hidden, layers = args.hidden or 128, args.layers or 2
        return build_tiny_model(
            ROOT / ".cache" / f"bench-qwen2-h{hidden}-l{layers}", hidden=hidden, layers=layers
        )
    return Path(args.model)


def rollout_argv(args: argparse.Namespace, model: Path) -> list[str]:
    """The rollout flags both sides are built from (the service parses them, the bare engine too)."""
    return [
        "--model", str(model), "--engine", "vllm", "--dtype", args.dtype,
        "--vllm.kv-cache-space-gib", str(args.kv_cache_gib), "--vllm.max-num-seqs", str(args.max_num_seqs),
        "--max-in-flight", str(max(256, args.prompts)), "--max-message-bytes", str(MAX_MESSAGE_BYTES),
        *args.rollout_arg,
    ]  # fmt: skip


def cpu_s(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class Bare:
    """Bare vLLM: the service's own engine construction, then `AsyncLLM.generate` directly."""

    def __init__(self, argv: list[str]) -> None:
        from services.rollout.config import RolloutSettings
        from services.rollout.vllm_engine import VllmEngine

        self.settings = RolloutSettings.from_cli(argv, prog="bench")
        self.engine = VllmEngine(self.settings)
        self.llm: Any = None

    async def start(self) -> None:
        await self.engine.start()
        self.llm = self.engine._llm  # the AsyncLLM the service would drive

    def engine_processes(self, exclude: set[int]) -> list[psutil.Process]:
        me = psutil.Process()
        return [p for p in me.children(recursive=True) if p.pid not in exclude]

    async def run(self, prompt_ids: list[list[int]], args: argparse.Namespace, tag: str) -> list[list[Any]]:
        """One request per prompt with `n` samples; returns each prompt's completions."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # What a plain vLLM user asks for: all samples at once, the final outputs only, the
        # sampled tokens' logprobs in vLLM's cheapest form (flat lists), and the text (vLLM's
        # detokenizer; --no-bare-text: none, the engine-only floor).
        params = SamplingParams(
            n=args.n,
            temperature=args.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=args.max_tokens,
            seed=args.seed or None,
            logprobs=0,
            flat_logprobs=True,
            detokenize=not args.no_bare_text,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

        async def one(i: int, ids: list[int]) -> list[Any]:
            final = None
            async for output in self.llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"{tag}-{i}"):
                final = output
            assert final is not None and len(final.outputs) == args.n
            return [(o.index, o.token_ids, o.logprobs) for o in final.outputs]

        return await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompt_ids)))

    async def stop(self) -> None:
        await self.engine.stop()


async def run_service(
    stub: Any, client: Any, prompts: list[str], args: argparse.Namespace, tag: str
) -> tuple[list[list[Any]], int, int]:
    """All prompts at once, each as the scheduler sends a group (`--calls batched`: its rollout client,
    which sends those issued together as one GenerateBatch call) or as a Generate call of its own
    (`--calls per-prompt`); returns each prompt's completions, the calls made and the stream messages
    that carried them (the service sends completions that finish in one engine step together)."""
    from grpo.common.v1 import types_pb2
    from grpo.rollout.v1 import rollout_pb2

    if args.calls == "batched":
        from services.scheduler.peers.clients import Sampling

        group = Sampling(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        calls, messages = client.batcher.calls, client.batcher.messages
        per_prompt = await asyncio.gather(
            *(
                client.generate(f"{tag}-{i}", types_pb2.Prompt(id=f"p{i}", text=text), group)
                for i, text in enumerate(prompts)
            )
        )
        return per_prompt, client.batcher.calls - calls, client.batcher.messages - messages

    sampling = types_pb2.SamplingParams(
        n=args.n, temperature=args.temperature, top_p=1.0, max_tokens=args.max_tokens, seed=args.seed
    )

    async def one(i: int, text: str) -> list[Any]:
        request = rollout_pb2.GenerateRequest(
            request_id=f"{tag}-{i}", prompt=types_pb2.Prompt(id=f"p{i}", text=text), sampling_params=sampling
        )
        return [list(response.completions) async for response in stub.Generate(request, timeout=600)]

    per_prompt = await asyncio.gather(*(one(i, text) for i, text in enumerate(prompts)))
    completions = [[c for message in messages for c in message] for messages in per_prompt]
    return completions, len(prompts), sum(map(len, per_prompt))


def token_lists(side: str, outputs: list[list[Any]]) -> list[list[tuple[int, ...]]]:
    """Per prompt, the completions' token ids ordered by sample index."""
    rows = []
    for completions in outputs:
        if side == "bare":
            ordered = sorted(completions, key=lambda c: c[0])
            rows.append([tuple(c[1]) for c in ordered])
        else:
            ordered = sorted(completions, key=lambda c: c.index)
            rows.append([tuple(c.completion_token_ids) for c in ordered])
    return rows


def start_profiler(pid: int, out: str, native: bool) -> subprocess.Popen:
    """py-spy sampling the rollout process (main thread and others; not the engine processes) during the
    timed runs; written as a raw collapsed-stack file (`flamegraph.pl`, speedscope) to `out`."""
    py_spy = Path(sys.executable).with_name("py-spy")
    command = [str(py_spy), "record", "--pid", str(pid), "--rate", "200", "--threads",
               "--format", "raw", "--output", out]  # fmt: skip
    command += ["--native"] if native else ["--nonblocking"]  # native frames need the process paused
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


async def measure(args: argparse.Namespace, model: Path, run_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from grpo.rollout.v1 import rollout_pb2_grpc
    from services.common.clients import open_channel
    from services.launch.processes import ServiceProcess
    from services.scheduler.peers.config import TimeoutSettings
    from services.scheduler.peers.grpc_clients import GrpcRolloutClient

    argv = rollout_argv(args, model)
    texts = build_prompts(args.prompts * args.batches, args.prompt_seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = [list(tokenizer(text, add_special_tokens=True)["input_ids"]) for text in texts]
    batches = [
        (texts[b * args.prompts : (b + 1) * args.prompts], ids[b * args.prompts : (b + 1) * args.prompts])
        for b in range(args.batches)
    ]

    service = ServiceProcess("rollout", run_dir, args=argv)
    service.start()  # --port 0 --port-file; its log goes to <run_dir>/logs/rollout.log
    bare = Bare(argv)
    try:
        # Both engines start at once (start-up is not measured); the runs begin when both are up.
        address, _ = await asyncio.gather(service.wait_ready(timeout=900), bare.start())
        # As the rollout service does after start-up (and vLLM's own server): the start-up heap out of
        # the collector's reach, or a full collection of it stalls a bare run now and then.
        gc.collect()
        gc.freeze()
        service_process = psutil.Process(service.process.pid)
        service_tree = {service_process.pid, *(p.pid for p in service_process.children(recursive=True))}
        bare_engine = bare.engine_processes(exclude=service_tree)
        service_engine = service_process.children(recursive=True)
        me = psutil.Process()
        channel = open_channel(address, MAX_MESSAGE_BYTES)
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        client = GrpcRolloutClient(address, TimeoutSettings(generate=600.0))  # the scheduler's client
        runs: list[Run] = []
        identical: list[float] = []
        profiler = None
        try:
            schedule = [(side, -1) for side in ("bare", "service")]
            schedule += [(side, r) for r in range(args.repeats) for side in ("bare", "service")]
            for side, repeat in schedule:
                await asyncio.sleep(args.pause)  # the other engine's busy-wait (1 s) has ended
                if args.profile_service and repeat == 0 and profiler is None:
                    profiler = start_profiler(service_process.pid, args.profile_service, args.profile_native)
                tag = f"{side}-{repeat}"
                front = me if side == "bare" else service_process
                engine = bare_engine if side == "bare" else service_engine
                before = (cpu_s([front]), cpu_s(engine), cpu_s([me]))
                started = time.perf_counter()
                outputs, calls, messages = [], 0, 0
                for b, (prompts, prompt_ids) in enumerate(batches):  # one after the other
                    if side == "bare":
                        outputs += await bare.run(prompt_ids, args, f"{tag}-{b}")
                    else:
                        completions, made, sent = await run_service(stub, client, prompts, args, f"{tag}-{b}")
                        outputs, calls, messages = outputs + completions, calls + made, messages + sent
                wall = time.perf_counter() - started
                after = (cpu_s([front]), cpu_s(engine), cpu_s([me]))
                tokens = token_lists(side, outputs)
                run = Run(
                    side=side,
                    repeat=repeat,
                    wall_s=wall,
                    completions=sum(len(row) for row in tokens),
                    tokens=sum(len(ids) for row in tokens for ids in row),
                    frontend_cpu_s=after[0] - before[0],
                    engine_cpu_s=after[1] - before[1],
                    client_cpu_s=(after[2] - before[2]) if side == "service" else 0.0,
                    calls=calls,
                    messages=messages,
                )
                runs.append(run)
                if side == "service":
                    for i, completions in enumerate(outputs):
                        got = list(completions[0].prompt_token_ids) if completions else []
                        if got != ids[i]:
                            raise SystemExit(f"prompt {i}: service tokenized {got}, bare got {ids[i]}")
                if repeat >= 0 and side == "bare":
                    bare_tokens = tokens
                elif repeat >= 0:
                    same = sum(
                        a == b
                        for x, y in zip(bare_tokens, tokens, strict=True)
                        for a, b in zip(x, y, strict=False)
                    )
                    identical.append(same / max(1, run.completions))
                if not args.json:
                    print(
                        f"{tag:<12} {run.wall_s:7.3f} s {run.tokens:7d} tok {run.tokens_per_s:9.1f} tok/s "
                        f"{run.completions_per_s:8.1f} compl/s  front-end CPU {run.frontend_cpu_s:5.2f} s  "
                        f"engine CPU {run.engine_cpu_s:5.2f} s  client CPU {run.client_cpu_s:5.2f} s"
                        f"  calls {run.calls}  messages {run.messages}",
                        flush=True,
                    )
        finally:
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
                profiler.wait(timeout=60)
            await channel.close()
            await client.close()
    finally:
        service.terminate(grace=60)
        await bare.stop()
    return summarize(args, model, runs, identical)


def summarize(
    args: argparse.Namespace, model: Path, runs: list[Run], identical: list[float]
) -> dict[str, Any]:
    import services

    timed = [r for r in runs if r.repeat >= 0]
    by_side = {side: [r for r in timed if r.side == side] for side in ("bare", "service")}
    pairs = list(zip(by_side["bare"], by_side["service"], strict=True))
    summary: dict[str, Any] = {}
    for side, rows in by_side.items():
        summary[side] = {
            "tokens_per_s": spread([r.tokens_per_s for r in rows]),
            "completions_per_s": spread([r.completions_per_s for r in rows]),
            "tokens_per_completion": statistics.mean(r.tokens / r.completions for r in rows),
            "frontend_cpu_s": spread([r.frontend_cpu_s for r in rows]),
            "engine_cpu_s": spread([r.engine_cpu_s for r in rows]),
            "client_cpu_s": spread([r.client_cpu_s for r in rows]),
        }
    summary["ratio_tokens_per_s"] = spread([s.tokens_per_s / b.tokens_per_s for b, s in pairs])
    summary["ratio_completions_per_s"] = spread([s.completions_per_s / b.completions_per_s for b, s in pairs])
    summary["identical_completions"] = statistics.mean(identical) if identical else None
    keys = ["prompts", "batches", "n", "max_tokens", "temperature", "seed", "repeats", "no_bare_text"]
    keys += ["dtype", "kv_cache_gib", "max_num_seqs", "calls"]
    config = {key: getattr(args, key) for key in keys}
    return {
        "model": str(model),
        "services": str(Path(services.__file__).parent),  # which tree was measured
        "config": config,
        "summary": summary,
        "runs": [r.row() for r in runs],
    }


def print_summary(result: dict[str, Any]) -> None:
    s, c = result["summary"], result["config"]
    print(
        f"\n{result['services']}\nmodel {result['model']}: "
        f"{c['batches']} x {c['prompts']} prompts x n={c['n']} x <= {c['max_tokens']} tokens, "
        f"T={c['temperature']}, seed {c['seed']}, {c['repeats']} pairs (median [min, max])"
    )
    for side in ("bare", "service"):
        row = s[side]
        tps, cps = row["tokens_per_s"], row["completions_per_s"]
        print(
            f"{side:<8} {tps['median']:9.1f} tok/s [{tps['min']:.1f}, {tps['max']:.1f}]  "
            f"{cps['median']:8.1f} compl/s [{cps['min']:.1f}, {cps['max']:.1f}]  "
            f"{row['tokens_per_completion']:.1f} tok/compl  "
            f"front-end CPU {row['frontend_cpu_s']['median']:.2f} s  "
            f"engine CPU {row['engine_cpu_s']['median']:.2f} s"
        )
    ratio, cratio = s["ratio_tokens_per_s"], s["ratio_completions_per_s"]
    print(
        f"service/bare tokens/s {ratio['median']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}]  "
        f"completions/s {cratio['median']:.3f} [{cratio['min']:.3f}, {cratio['max']:.3f}]  "
        f"identical completions {s['identical_completions']:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: the demo's)")
    parser.add_argument("--hidden", type=int, default=0, help="build and use a random Qwen2 this wide")
    parser.add_argument("--layers", type=int, default=0, help="... and this deep (tiny_model's tokenizer)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument(
        "--batches", type=int, default=4, help="prompt sets per run, one after the other (new prompts each)"
    )
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1, help="sampling seed (sample i: seed+i); 0 = unseeded")
    parser.add_argument("--prompt-seed", type=int, default=0, help="seed of the arithmetic prompts")
    parser.add_argument("--repeats", type=int, default=5, help="timed (bare, service) pairs")
    parser.add_argument("--pause", type=float, default=1.5, help="seconds between runs")
    parser.add_argument(
        "--no-bare-text", action="store_true", help="bare vLLM without detokenization (no text)"
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--rollout-arg", action="append", default=[], help="extra rollout flag for both sides (repeatable)"
    )
    parser.add_argument(
        "--profile-service",
        default="",
        metavar="FILE",
        help="py-spy record the rollout process during the timed runs into FILE (collapsed stacks)",
    )
    parser.add_argument("--profile-native", action="store_true", help="with native (C/Cython) frames")
    parser.add_argument(
        "--calls",
        choices=["batched", "per-prompt"],
        default="batched",
        help="how the service side sends the prompts: as the scheduler does (its rollout client: the "
        "prompts issued together in one GenerateBatch call) or a Generate call per prompt",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.json:  # vLLM logs to stdout by default; keep stdout for the JSON object
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    model = resolve_model(args)
    import uvloop  # the service's loop, for the bare side too

    with tempfile.TemporaryDirectory(prefix="rollout-overhead-") as tmp:
        result = uvloop.run(measure(args, model, Path(tmp)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_summary(result)


if __name__ == "__main__":
    main()
