"""Where do learner and rollout logprobs disagree? One rollout process and one learner process on the
same checkpoint (fp32 on both sides, version 0) score the same token sequences through their
`ScoreTokens`, and the bench prints max |Δ logprob| per part of each sequence:

- `single`: an env's first eval prompt and one seeded completion of up to `--tokens` tokens;
- `multi`: the probe a multi-turn run checks after every sync (`pipeline/alignment.py`): that
  completion, a user turn appended as tokens (`RenderMessages` bridge) and a second model turn
  generated token-in, split into its first model turn, the environment's tokens and the second turn;

each at every `--temperatures` (1.0 scores one prefill on vLLM; other temperatures one request a
position). Parts are also split by position (`--window` tokens each), to tell length from turns.

The rollout scores each sequence `--repeats` times; with `--load N` it generates N other requests
all the while (as it does in a run, where the probe follows a commit while generation goes on), and
the bench also prints the rollout's disagreement with itself across repeats: a kernel whose result
depends on the batch around a sequence shows there, learner or not.

With `--lora-checkpoint` (a LoRA run's learner checkpoint) both services hold the adapter merged into
the base weights, and the bench also scores each sequence in this process with the adapter unmerged
(the learner's forward: base and adapter paths added) against merged (what a full-format sync gives
the rollouts): what merging alone changes (`merge`), with the same kernels on both sides.

    B="flock /tmp/cpu.lock .venv/bin/python bench/alignment.py"
    $B --model smollm2 --env tool_arithmetic
    $B --model smollm2 --lora-checkpoint RUN_DIR/checkpoints/step_00000040/model.safetensors

The services run as the launcher runs them (`ServiceProcess`: they die with the bench, even a killed
one) with their logs in `--work-dir` (runs/bench-alignment), emptied at each start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from grpo.common.v1 import types_pb2  # noqa: E402
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc  # noqa: E402
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc  # noqa: E402
from services.launch.processes import ServiceProcess, terminate_all  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="A checkpoint directory or a known model name.")
    parser.add_argument("--env", default="tool_arithmetic", help="The env whose first eval prompt is used.")
    parser.add_argument(
        "--env-arg", action="append", default=[], help="An env option key=value (repeatable; as the demo's)."
    )
    parser.add_argument("--engine", default="vllm", choices=["vllm", "transformers"])
    parser.add_argument(
        "--lora-checkpoint", type=Path, default=None,
        help="A learner checkpoint's model.safetensors of a LoRA run: both services then hold its merged "
        "weights, and the bench also scores each sequence in-process with the adapter unmerged (as the "
        "learner trains) against merged (as the rollout holds them): the part merging alone accounts for.",
    )  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=16, help="The rank of --lora-checkpoint's adapter.")
    parser.add_argument("--tokens", type=int, default=48, help="max_tokens of each model turn.")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--window", type=int, default=64, help="Positions per row of the by-position split.")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=1, help="Rollout scores of each sequence.")
    parser.add_argument("--load", type=int, default=0, help="Other generations in flight meanwhile.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    parser.add_argument(
        "--work-dir", type=Path, default=REPO / "runs" / "bench-alignment",
        help="The services' logs and port files, and the merged model of --lora-checkpoint: emptied at "
        "each start (so a killed bench leaves one directory that the next run replaces), kept after.",
    )  # fmt: skip
    return parser.parse_args(argv)


def model_dir(name: str) -> Path:
    path = Path(name)
    if path.is_dir():
        return path
    from services.launch import pretrained

    known = pretrained.lookup(name)
    if known is None:
        raise SystemExit(f"--model {name}: neither a directory nor a known model")
    return pretrained.prepare_model(known, REPO / ".cache")


def first_prompt(spec: str, env_args: list[str]) -> types_pb2.Prompt:
    from services.env.episodes import tools_json
    from services.env.loader import load_environment
    from services.env.servicer import prompt_to_proto

    env = load_environment(spec, dict(arg.split("=", 1) for arg in env_args))
    return prompt_to_proto(env.prompt_at("eval", 0), spec, tools_json(env))


async def generate(
    rollout: Any, prompt: types_pb2.Prompt, args: argparse.Namespace, prefix: list[int] | None = None
) -> types_pb2.Completion:
    request = rollout_pb2.GenerateRequest(
        request_id=f"align-{time.monotonic_ns()}", prompt=prompt,
        sampling_params=types_pb2.SamplingParams(
            n=1, temperature=0.7, top_p=1.0, max_tokens=args.tokens, seed=args.seed
        ),
        prompt_token_ids=prefix or [],
    )  # fmt: skip
    completions = [c async for r in rollout.Generate(request, timeout=600) for c in r.completions]
    return completions[0]


async def sequences(rollout: Any, prompt: types_pb2.Prompt, args: argparse.Namespace) -> dict[str, Any]:
    """{name: (prompt ids, completion ids, [(part, start, end)])}: the single- and the multi-turn one."""
    first = await generate(rollout, prompt, args)
    prompt_ids, turn = list(first.prompt_token_ids), list(first.completion_token_ids)
    bridge_request = rollout_pb2.RenderMessagesRequest(
        mode=rollout_pb2.RENDER_MODE_BRIDGE, messages=[types_pb2.ChatMessage(role="user", content="Go on.")],
        tools_json=prompt.tools_json, add_generation_prompt=True, previous_tail=turn[-8:],
    )  # fmt: skip
    bridge = list((await rollout.RenderMessages(bridge_request, timeout=60)).token_ids)
    second = list((await generate(rollout, prompt, args, prompt_ids + turn + bridge)).completion_token_ids)
    multi = turn + bridge + second
    long_args = argparse.Namespace(**{**vars(args), "tokens": len(multi)})
    single = list((await generate(rollout, prompt, long_args)).completion_token_ids)
    a, b = len(turn), len(turn) + len(bridge)
    return {
        "single": (prompt_ids, single, [("model", 0, len(single))]),
        "multi": (
            prompt_ids,
            multi,
            [("model turn 1", 0, a), ("env turn", a, b), ("model turn 2", b, len(multi))],
        ),
    }


async def score(
    learner: Any, rollout: Any, prompt_ids: list[int], ids: list[int], t: float, repeats: int
) -> tuple[list[float], float, list[float]]:
    """Max |learner − rollout| per token over `repeats` rollout scores, the rollout's own spread (max
    over tokens of max − min across its repeats), and the learner's logprobs."""
    sequence = types_pb2.TokenSequence(prompt_token_ids=prompt_ids, completion_token_ids=ids, temperature=t)
    ours = (
        await learner.ScoreTokens(learner_pb2.ScoreTokensRequest(sequence=sequence), timeout=600)
    ).logprobs
    request = rollout_pb2.ScoreTokensRequest(sequence=sequence)
    theirs = [(await rollout.ScoreTokens(request, timeout=600)).logprobs for _ in range(repeats)]
    diffs = [max(abs(a - r[i]) for r in theirs) for i, a in enumerate(ours)]
    spread = max((max(col) - min(col) for col in zip(*theirs, strict=True)), default=0.0)
    return diffs, spread, list(ours)


class LoraPair:
    """A LoRA checkpoint twice, in this process: the adapter unmerged (the learner's forward) and merged
    into the base weights (what a full-format sync gives the rollouts), the merged one also saved to
    `out` for the services."""

    def __init__(self, base: Path, checkpoint: Path, rank: int, out: Path) -> None:
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from services.learner.config import LoraConfig
        from services.learner.model import export_state, load_policy

        self.unmerged = load_policy(str(base), torch.device("cpu"), LoraConfig(rank=rank))
        missing, unexpected = self.unmerged.load_state_dict(load_file(checkpoint), strict=False)
        if unexpected or any(".lora_" in key for key in missing):  # it holds the adapter only
            raise SystemExit(f"{checkpoint}: not a rank-{rank} adapter of this model ({unexpected[:3]})")
        self.merged = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        self.merged.load_state_dict(export_state(self.unmerged, "full"), strict=True)
        self.unmerged.eval(), self.merged.eval()
        self.merged.save_pretrained(out)
        AutoTokenizer.from_pretrained(str(base)).save_pretrained(out)

    def diffs(self, prompt_ids: list[int], ids: list[int], temperature: float) -> list[float]:
        """|unmerged − merged| logprob per completion token."""
        import torch

        from services.learner.batching import Sample, collate
        from services.learner.model import token_logprobs

        sample = Sample(tuple(prompt_ids), tuple(ids), (0.0,) * len(ids), 0.0, temperature)
        batch = collate([sample])
        with torch.no_grad():
            a, b = token_logprobs(self.unmerged, batch)[0][0], token_logprobs(self.merged, batch)[0][0]
        return (a - b).abs().tolist()


def by_position(diffs: list[float], offset: int, window: int) -> dict[str, float]:
    """Max |Δ| per `window` positions, keyed "first-last" in sequence positions."""
    chunks = [diffs[i : i + window] for i in range(0, len(diffs), window)]
    return {f"{offset + i * window}-{offset + i * window + len(c)}": max(c) for i, c in enumerate(chunks)}


async def keep_busy(rollout: Any, prompt: types_pb2.Prompt, args: argparse.Namespace, lane: int) -> None:
    """Generate, unseeded, until cancelled: the traffic a probe meets in a run."""
    while True:
        request = rollout_pb2.GenerateRequest(
            request_id=f"load-{lane}-{time.monotonic_ns()}", prompt=prompt,
            sampling_params=types_pb2.SamplingParams(n=4, temperature=0.7, top_p=1.0, max_tokens=args.tokens),
        )  # fmt: skip
        async for _ in rollout.Generate(request, timeout=600):
            pass


async def measure(
    learner: Any,
    rollout: Any,
    sequence: tuple[list[int], list[int], list[tuple[str, int, int]]],
    t: float,
    args: argparse.Namespace,
    lora: LoraPair | None,
) -> dict[str, Any]:
    """One sequence at temperature `t`: max |Δ| overall, per part, per position window, at its worst
    token (and what merging the adapter changes, with `lora`)."""
    prompt_ids, ids, parts = sequence
    diffs, spread, logprobs = await score(learner, rollout, prompt_ids, ids, t, args.repeats)
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    row = {
        "prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
        "max": max(diffs), "rollout_self_spread": spread,
        "worst": {"position": len(prompt_ids) + worst, "logprob": logprobs[worst]},
        "parts": {p: max(diffs[a:b], default=0.0) for p, a, b in parts},
        "by_position": by_position(diffs, len(prompt_ids), args.window),
    }  # fmt: skip
    if lora is not None:
        merge = await asyncio.to_thread(lora.diffs, prompt_ids, ids, t)
        row["merge"] = {p: max(merge[a:b], default=0.0) for p, a, b in parts}
    return row


async def main_async(args: argparse.Namespace, model: Path, lora: LoraPair | None) -> dict[str, Any]:
    work = args.work_dir
    prompt = first_prompt(args.env, args.env_arg)
    common = ["--model", str(model), "--dtype", "float32"]
    services = [  # as the launcher runs them: die with the bench, stopped by pid and process group
        ServiceProcess("rollout", work, [*common, "--engine", args.engine]),
        ServiceProcess("learner", work, common),
    ]
    try:
        for service in services:
            service.start()
        addresses = [await service.wait_ready(600) for service in services]
        async with (
            grpc.aio.insecure_channel(addresses[0]) as rc,
            grpc.aio.insecure_channel(addresses[1]) as lc,
        ):
            rollout = rollout_pb2_grpc.RolloutServiceStub(rc)
            learner = learner_pb2_grpc.LearnerServiceStub(lc)
            made = await sequences(rollout, prompt, args)
            load = [asyncio.create_task(keep_busy(rollout, prompt, args, i)) for i in range(args.load)]
            results: dict[str, Any] = {}
            for name, sequence in made.items():
                for t in args.temperatures:
                    row = results[f"{name} T={t:g}"] = await measure(
                        learner, rollout, sequence, t, args, lora
                    )
                    print(f"{name} T={t:g}: {json.dumps(row)}", flush=True)
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
            return results
    finally:
        await asyncio.to_thread(terminate_all, services)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    model, lora = model_dir(args.model), None
    if args.lora_checkpoint:
        lora = LoraPair(model, args.lora_checkpoint, args.lora_rank, args.work_dir / "merged")
        model = args.work_dir / "merged"
    results = asyncio.run(main_async(args, model, lora))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
