"""Run a verifiers environment, unmodified, against grpo-mesh's gateway and submit scored groups.

    .venvs/verifiers/bin/python -m integrations.verifiers.run \\
        --env examples/verifiers_env.py:load_environment \\
        --gateway http://127.0.0.1:8000 --model ./model --group-size 4 --steps 20

It runs inside `.venvs/verifiers` (verifiers 0.4.0 pins openai<3 and mcp==2.0.0, which conflict with
grpo-mesh's own environment) and talks to grpo-mesh only over HTTP. Each step: take the next task of the
env's taskset, run `--group-size` rollouts of it with verifiers' own machinery (`Env.serving()`,
`Env.slots()`, `Env.run_slot()`: the env's harness, its runtime, its rubric), turn each finished rollout
into a full token sequence and mask (`sequences.py`), and POST the group to the gateway's trajectory API
(`/scored_data`, atropos' ScoredData shape) with verifiers' scores as the rewards. The gateway matches
every sampled span to a generation it served (tokens, behaviour logprobs, weight versions come from its
registry, never from here) and the scheduler trains the group. The run stops when the trainer's
`current_step` reaches `--steps` (or after `--max-groups` groups).

**Why verifiers' train client (the renderer route).** verifiers 0.4.0 ships only the `verifiers.v1`
API (no `SingleTurnEnv`/`MultiTurnEnv`/`ToolEnv`: a single-turn env is a `Taskset` with a `@vf.reward`
run by `SingleAgentEnv`, a multi-turn one an `Env` whose `run()` drives `interaction.turn(...)`). Its
harness programs talk to verifiers' interception server, which calls the model through one of two
clients. The eval client relays OpenAI chat completions and, by design, records no tokens
(`dialects/chat.py: response_from_wire`: "No token ids: training tokens come from the renderer
client"), so a trace made with it cannot be trained on token for token. The train client
(`TrainClientConfig`) is what verifiers and prime-rl train with: it renders the chat client-side
(`renderers`, the model's own tokenizer, `--model`), sends token ids to `POST /inference/v1/generate`
with `X-Session-ID: <trace id>` on every call of a rollout, records each call's prompt ids, completion
ids and logprobs in the trace's message graph, and builds later turns by bridging
(`renderer.bridge_to_next_turn(prev_prompt, prev_completion, new_messages)`) so earlier tokens are never
re-rendered. That is the faithful route: what verifiers records is exactly what the gateway generated.
renderers bridges only the model families it knows; for any other model the runner's default is our
`bridging.BridgingRenderer`, which bridges from the model's own chat template (renderers' extension
point, `CustomRendererConfig`). A renderer that cannot bridge (`--renderer default`) re-renders the
history; if that tokenizes differently, verifiers forks the trace into several branches and this
runner refuses the rollout (`not_token_exact`, counted, never submitted). A group with a refused rollout
is dropped whole: a GRPO group's advantages need all of its members.

Output: one JSON line per group on stderr (scores, what the gateway answered) and a final summary JSON
on stdout; `--groups-out FILE` also writes each group (tokens, masks, scores, session ids) as JSONL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from integrations.verifiers.loader import load_env_factory, parse_env_args
from integrations.verifiers.sequences import Rejected, Sequence, episode_sequence
from integrations.verifiers.trajectory import Refused, TrajectoryClient, Unavailable, auth_headers

# A chat template that renders each message's content and nothing else (`--raw-prompt`): the prompt is
# the task's text as is, and the reply ends where the model ends it (its EOS, the renderer's stop token)
RAW_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
BRIDGING = "integrations.verifiers.bridging.BridgingRenderer"  # renderers' CustomRendererConfig import path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m integrations.verifiers.run", description=__doc__.split("\n")[0]
    )
    p.add_argument("--env", required=True, help="PATH.py:FUNCTION or module:FUNCTION returning a vf.Env")
    p.add_argument(
        "--env-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument for the env function (VALUE parsed as JSON, else a string); repeatable",
    )
    p.add_argument("--gateway", required=True, help="the gateway's root URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--model",
        required=True,
        help="the model directory (or HF name) whose tokenizer renders prompts: the rollouts' model",
    )
    p.add_argument(
        "--served-model-name", default="", help="model name sent to the gateway (default: /v1/models' first)"
    )
    p.add_argument(
        "--renderer",
        default="",
        help="renderers' renderer name, or 'bridging' (ours: turns bridged from the model's chat template). "
        "Default: renderers' own for a model in its map, else 'bridging'",
    )
    p.add_argument(
        "--raw-prompt",
        action="store_true",
        help="render the messages' contents only, no chat markup (the renderer with RAW_TEMPLATE as its "
        "chat template): for a base model trained on raw prompts, e.g. the tiny test model's '3+4='",
    )
    p.add_argument("--group-size", type=int, default=4, help="rollouts per task (the GRPO group)")
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="stop once the trainer's current_step reaches this (0 = no limit)",
    )
    p.add_argument(
        "--max-groups", type=int, default=0, help="stop after this many groups are submitted (0 = no limit)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="passed to the env function as `seed` when it takes one and --env-arg does not set it",
    )
    p.add_argument("--max-tokens", type=int, default=16, help="max tokens per model call")
    p.add_argument(
        "--temperature", type=float, default=1.0, help="sampling temperature (the gateway needs > 0)"
    )
    p.add_argument("--concurrency", type=int, default=8, help="rollouts in flight at once (across groups)")
    p.add_argument(
        "--max-queued",
        type=int,
        default=4,
        help="hold off starting groups while /status-env's queue_size is at least this",
    )
    p.add_argument(
        "--poll-interval-s", type=float, default=0.5, help="how often /status-env is read while holding off"
    )
    p.add_argument(
        "--submit-timeout-s",
        type=float,
        default=120.0,
        help="deadline of one /scored_data call (the gateway may hold it while the queue is full)",
    )
    p.add_argument(
        "--retry-deadline-s", type=float, default=300.0, help="give up on 5xx/429/transport errors after this"
    )
    p.add_argument(
        "--max-dropped",
        type=int,
        default=10,
        help="end the run (exit 3) after this many groups in a row were dropped for refused rollouts",
    )
    p.add_argument("--name", default="verifiers", help="desired_name at /register-env")
    p.add_argument(
        "--no-submit",
        action="store_true",
        help="do not use the trajectory API (no register, no submit): only build groups (needs --max-groups)",
    )
    p.add_argument("--groups-out", type=Path, default=None, help="also write each group as a JSON line here")
    return p


class Runner:
    def __init__(self, args: argparse.Namespace, env, ctx) -> None:
        self.args = args
        self.env = env
        self.ctx = ctx
        self.counts: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()
        self.rewards: list[float] = []
        self.step = 0
        self.dropped_in_a_row = 0
        self.stop = asyncio.Event()
        self.client: TrajectoryClient | None = None
        self.out = args.groups_out.open("a") if args.groups_out else None
        self.started = time.monotonic()

    def log(self, **fields: Any) -> None:
        print(
            json.dumps({"t": round(time.monotonic() - self.started, 2), **fields}),
            file=sys.stderr,
            flush=True,
        )

    async def run_group(self, index: int, task, semaphore: asyncio.Semaphore) -> list[Sequence] | None:
        slots = self.env.slots(task, self.args.group_size)
        episodes = await asyncio.gather(*(self.env.run_slot(slot, self.ctx, semaphore) for slot in slots))
        sequences: list[Sequence] = []
        for episode in episodes:
            result = episode_sequence(episode)
            self.counts["rollouts"] += 1
            if isinstance(result, Rejected):
                self.rejections[result.kind] += 1
                self.log(
                    event="rollout refused",
                    group=index,
                    kind=result.kind,
                    reason=result.reason,
                    session_id=result.session_id,
                )
            else:
                sequences.append(result)
        if len(sequences) != len(episodes):
            self.counts["groups_dropped"] += 1
            self.dropped_in_a_row += 1
            if self.dropped_in_a_row >= self.args.max_dropped:
                self.counts["gave_up"] = 1
                self.stop.set()
            return None
        self.dropped_in_a_row = 0
        return sequences

    async def submit(self, index: int, task, sequences: list[Sequence]) -> None:
        group = {
            "tokens": [s.tokens for s in sequences],
            "masks": [s.masks for s in sequences],
            "scores": [s.score for s in sequences],
        }
        scores = group["scores"]
        self.rewards.extend(scores)
        answer: dict[str, Any] | str = "not submitted"
        if self.client is not None:
            try:
                answer = await self.client.submit(group)
                self.counts["groups_submitted"] += 1
            except Refused as exc:
                self.counts["groups_refused"] += 1
                answer = f"refused {exc.status}: {exc.reason}"
        else:
            self.counts["groups_built"] += 1
        if self.out is not None:
            record = {
                **group,
                "group": index,
                "task": task.data.name,
                "session_ids": [s.session_id for s in sequences],
                "spans": [s.spans for s in sequences],
                "logprobs": [s.logprobs for s in sequences],
            }
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()
        self.log(event="group", group=index, task=task.data.name, scores=scores, answer=answer)
        done = self.counts["groups_submitted"] + self.counts["groups_built"]
        if self.args.max_groups and done >= self.args.max_groups:
            self.stop.set()

    async def unless_stopped(self, call: Any) -> Any:
        """`call`'s result, or None once the run is stopping (a call retrying against a gateway that is
        gone would hold the runner past a launcher's grace period)."""
        task, stopping = asyncio.ensure_future(call), asyncio.ensure_future(self.stop.wait())
        done, _ = await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for waiting in (task, stopping):
            if waiting not in done:
                waiting.cancel()
        await asyncio.gather(task, stopping, return_exceptions=True)
        return task.result() if task in done else None

    async def refresh_step(self) -> dict[str, Any] | None:
        if self.client is None:
            return None
        status = await self.unless_stopped(self.client.status())
        if status is None:
            return None
        self.step = int(status.get("current_step", 0))
        if self.args.steps and self.step >= self.args.steps:
            self.stop.set()
        return status

    async def wait_for_room(self) -> None:
        """Hold off while the trainer's queue is at --max-queued (what /status-env reports)."""
        while not self.stop.is_set():
            status = await self.refresh_step()
            if status is None or int(status.get("queue_size", 0)) < self.args.max_queued:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.args.poll_interval_s)

    async def one_group(self, index: int, task, semaphore: asyncio.Semaphore) -> None:
        sequences = await self.run_group(index, task, semaphore)
        if sequences is not None and not self.stop.is_set():
            await self.submit(index, task, sequences)
        await self.refresh_step()

    async def run(self) -> dict[str, Any]:
        args = self.args
        semaphore = asyncio.Semaphore(args.concurrency)
        in_flight_groups = max(1, -(-args.concurrency // args.group_size))
        tasks = iter(self.env.taskset)
        pending: set[asyncio.Task] = set()
        index = 0
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(
                signal.SIGTERM, self.stop.set
            )  # stop cleanly: harness processes are reaped
        async with self.env.serving():
            await self.refresh_step()
            stopping = asyncio.create_task(self.stop.wait())
            while not self.stop.is_set():
                while len(pending) >= in_flight_groups and not self.stop.is_set():
                    # a stop (SIGTERM) ends the wait at once: a group still waiting on a gateway that
                    # is gone (retrying until --retry-deadline-s) would outlast a launcher's grace
                    done, _ = await asyncio.wait({*pending, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    for finished in done - {stopping}:
                        pending.discard(finished)
                        finished.result()  # a failure of the runner itself ends the run
                if self.stop.is_set():
                    break
                await self.wait_for_room()
                if self.stop.is_set():
                    break
                task = next(tasks, None)
                if task is None:  # a finite taskset is done: its last groups still count
                    for finished in await asyncio.gather(*pending, return_exceptions=True):
                        if isinstance(finished, Exception):
                            raise finished
                    pending = set()
                    break
                pending.add(asyncio.create_task(self.one_group(index, task, semaphore)))
                index += 1
            # the summary goes out now, before the cleanup below: stopping verifiers' harness programs
            # can outlast a launcher's grace period, and a SIGKILL then would lose it
            summary = self.summary()
            print(json.dumps(summary), flush=True)
            for leftover in (*pending, stopping):
                leftover.cancel()
            await asyncio.gather(*pending, stopping, return_exceptions=True)
        return summary

    def summary(self) -> dict[str, Any]:
        k = min(len(self.rewards) // 2, 20 * self.args.group_size)
        first = self.rewards[:k]
        last = self.rewards[-k:] if k else []
        return {
            **{
                key: self.counts.get(key, 0)
                for key in (
                    "rollouts",
                    "groups_submitted",
                    "groups_built",
                    "groups_refused",
                    "groups_dropped",
                    "gave_up",
                )
            },
            "rollouts_refused": dict(self.rejections),
            "current_step": self.step,
            "reward_mean": sum(self.rewards) / len(self.rewards) if self.rewards else None,
            "reward_first": sum(first) / len(first) if first else None,
            "reward_last": sum(last) / len(last) if last else None,
            "seconds": round(time.monotonic() - self.started, 2),
        }


async def served_model(gateway: str, deadline_s: float = 10.0) -> tuple[str, int]:
    """The gateway's served model name and max_model_len (`GET /v1/models`)."""
    async with httpx.AsyncClient(timeout=deadline_s, headers=auth_headers()) as http:
        response = await http.get(f"{gateway}/v1/models")
        response.raise_for_status()
        card = response.json()["data"][0]
        return card["id"], int(card.get("max_model_len") or 0)


def renderer_config(name: str, model: str, raw_prompt: bool) -> dict[str, Any]:
    """The train client's renderer: `--renderer NAME` as given; else renderers' own renderer for a model
    in its map (it knows the model's tool and reasoning formats), and for any other model ours, which
    bridges turns from the model's chat template (`bridging.py`; renderers' `default` cannot, and a
    multi-turn rollout would not be token-exact). `--raw-prompt` renders with RAW_TEMPLATE."""
    from renderers.base import MODEL_RENDERER_MAP

    template = {"chat_template": RAW_TEMPLATE} if raw_prompt else {}
    if raw_prompt and name not in ("", "bridging", "default"):
        raise SystemExit(f"--raw-prompt renders with the bridging or default renderer, not {name!r}")
    if not name:
        name = "auto" if model in MODEL_RENDERER_MAP and not raw_prompt else "bridging"
    if name == "bridging":
        return {"name": "custom", "import_path": BRIDGING, **template}
    return {"name": name, **template}


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    import verifiers.v1 as vf
    from verifiers.v1.clients import ModelContext, TrainClientConfig

    gateway = args.gateway.rstrip("/")
    model_name, max_model_len = await served_model(gateway)
    factory = load_env_factory(args.env)
    env = factory(**parse_env_args(args.env_arg, factory, args.seed))
    client = TrainClientConfig.model_validate(
        {
            "base_url": f"{gateway}/v1",
            "api_key_var": "GRPO_TOKEN",
            "renderer_model_name": args.model,
            "renderer": renderer_config(args.renderer, args.model, args.raw_prompt),
        }
    )
    sampling = vf.SamplingConfig(temperature=args.temperature, max_tokens=args.max_tokens)
    ctx = ModelContext(model=args.served_model_name or model_name, client=client, sampling=sampling)
    runner = Runner(args, env, ctx)
    if not args.no_submit:
        runner.client = TrajectoryClient(
            gateway, call_timeout_s=args.submit_timeout_s, retry_deadline_s=args.retry_deadline_s
        )
        answer = await runner.client.register(
            name=args.name, group_size=args.group_size, max_token_length=max_model_len
        )
        runner.log(event="registered", env_id=runner.client.env_id, answer=answer)
    try:
        return await runner.run()
    finally:
        if runner.client is not None:
            await runner.client.close()
        if runner.out is not None:
            runner.out.close()


def offline_uv() -> None:
    """Let verifiers' subprocess runtime run its harness programs without the network. It runs each
    as a PEP 723 uv script (`uv sync --script`, UV_OFFLINE forced off), which resolves the script's
    dependencies from PyPI; scripts/venv_verifiers.sh put them, pinned, in the venv's `wheels/` as a
    PEP 503 index (`wheels/simple/`), which becomes uv's default index (in place of PyPI), with no
    Python downloads (each set only where the caller did not set it). `uv` itself is this venv's (its
    bin/ first on PATH), so verifiers installs none."""
    venv_bin = Path(sys.executable).parent
    os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    index = venv_bin.parent / "wheels" / "simple"
    if index.is_dir():
        os.environ.setdefault("UV_DEFAULT_INDEX", index.resolve().as_uri())
        os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.no_submit and not args.max_groups:
        raise SystemExit("--no-submit needs --max-groups (nothing else would end the run)")
    if args.group_size < 1 or args.concurrency < 1:
        raise SystemExit("--group-size and --concurrency must be >= 1")
    offline_uv()
    try:
        summary = asyncio.run(amain(args))
    except (Unavailable, Refused) as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        return 2
    return 3 if summary["gave_up"] else 0  # the summary was printed when the run ended (Runner.run)


if __name__ == "__main__":
    raise SystemExit(main())
