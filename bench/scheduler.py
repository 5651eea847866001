"""The scheduler alone: how many completions per second it routes into trained batches, and how much
latency it adds per group, against stub peers that answer instantly (every cost measured is the
scheduler's own, or gRPC's).

The real `Orchestrator` (services/scheduler/orchestrator.py) trains a whole run against stub peers,
in one of two modes:

  inproc    stub `EnvClient`, `LearnerClient` and `RolloutClient` objects
            (services/scheduler/peers/clients.py) on the scheduler's own event loop: the scheduler's
            ceiling. Every stub call answers on the loop's next turn, as a reply already waiting on a
            socket would.
  loopback  stub gRPC servers of the real protos (grpo/env, grpo/learner, grpo/rollout: one server for
            env + learner, one per rollout) on 127.0.0.1:0 in a child process, reached through the
            real clients of services/scheduler/peers/grpc_clients.py: the scheduler plus the cost of gRPC.

A stub rollout returns `--group-size` completions of `--tokens` tokens, every token stamped with the
version it holds; the stub env scores at once; the stub learner moves one version per TrainStep;
every weight sync (prepare, stage, commit, probe, release) succeeds at once. The scheduler logs as
the service does (structlog JSON, INFO), into /dev/null, and writes its metrics.jsonl to a temp dir.

Numbers, for each rollout count of `--rollouts`, measured after `--warmup-steps` steps:

  completions/s   completions that reach a trained batch per second: the completions of the TrainSteps
                  after the warm-up, over the time from the warm-up's last TrainStep returning to the
                  last one returning.
  cpu us/compl    this process's CPU time over the same window per completion routed (inproc: scheduler
                  and stubs; loopback: the scheduler with its gRPC clients, not the stub process): the
                  cost, and the number least disturbed by other load on a shared machine.
  added p50/p99   the latency the scheduler ADDS per group, from time.perf_counter stamps (the same
                  monotonic clock in both processes): from the moment the stub rollout has the group's
                  last completion available (inproc: the stub resolves the generate call; loopback: the
                  stub server yields its GenerateBatchResponse) to the moment the group is scored and
                  in the scheduler's `scored` queue, ready to be batched. It covers reading the answer,
                  the rollout's credit, the ledger, the scoring call, queueing, and any time the group
                  waits for the scheduler's busy event loop (over loopback also the stream's transfer and
                  the Score RPC). Groups that reach the queue after the warm-up count. Waiting for the
                  rest of its batch and for the trainer is not "added" (B and the learner set it): it is
                  `to batch p99`, available → taken into a batch.
  baselines       measured in the same run: the goals (20,000 completions/s in-process, p99 added ≤ 2 ms;
                  `x goal` = measured / goal), and for loopback an empty grpc.aio unary call between the
                  same two processes (raw bytes, no protobuf): its round trip (p50, one caller) and its
                  rate (64 concurrent callers). `added p99 / RTT` is the p99 in empty round trips;
                  `group = RPCs` is the empty-call rate over the groups routed per second: what one
                  group costs the scheduler, in empty round trips.

    flock /tmp/cpu.lock .venv/bin/python bench/scheduler.py                  # both modes, 1 8 64 rollouts
    .venv/bin/python bench/scheduler.py --mode inproc --rollouts 8 --steps 500 --json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import math
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import uvloop

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2, env_pb2_grpc
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import grpc_options, open_channel
from services.common.config import CONTROL_MESSAGE_BYTES
from services.common.logging import configure_logging
from services.scheduler.config import SchedulerSettings
from services.scheduler.orchestrator import Orchestrator
from services.scheduler.peers.clients import (
    Batch,
    EnvInfo,
    LearnerInfo,
    PreparedWeights,
    RolloutInfo,
    Sampling,
    Scores,
    StepResult,
    TokenScores,
)
from services.scheduler.peers.config import TimeoutSettings
from services.scheduler.peers.grpc_clients import GrpcEnvClient, GrpcLearnerClient, GrpcRolloutClient
from services.scheduler.peers.rollouts import RolloutPool

GOAL_COMPLETIONS_PER_S = 20_000.0
GOAL_ADDED_P99_MS = 2.0
PROMPT_TOKENS = 8
EMPTY_SERVICE, EMPTY_METHOD = "bench.Empty", "Call"
EMPTY_CALLERS = 64

# ---- stub peers (domain level; the loopback servicers wrap them) ---------------------------------------


def make_completions(n: int, version: int, tokens: int) -> list[types_pb2.Completion]:
    """A group as a rollout returns it: every token stamped with `version`."""
    sampling = types_pb2.SamplingParams(n=n, temperature=1.0, top_p=1.0, max_tokens=tokens)
    return [
        types_pb2.Completion(
            prompt_id="stub",
            index=i,
            prompt_token_ids=list(range(PROMPT_TOKENS)),
            completion_token_ids=[(7 * i + j) % 100 for j in range(tokens)],
            logprobs=[-1.0] * tokens,
            finish_reason=types_pb2.FINISH_REASON_LENGTH,
            version_spans=[types_pb2.WeightVersionSpan(version=version, start=0, end=tokens)],
            sampling_params=sampling,
            text=str(i),
            rollout_id="stub",
        )
        for i in range(n)
    ]


class GroupCache:
    """Groups built once per (version, n) and shared by every stub rollout of a process, so a stub's
    answer costs next to nothing: as completions (inproc) and as a GenerateResult to copy into a
    GenerateBatchResponse (loopback: the rollout service sends the completions of a call's requests
    that finish together in one message, and a stub's all finish at once)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self._completions: dict[tuple[int, int], list[types_pb2.Completion]] = {}
        self._results: dict[tuple[int, int], rollout_pb2.GenerateResult] = {}

    def completions(self, version: int, n: int) -> list[types_pb2.Completion]:
        key = (version, n)
        group = self._completions.get(key)
        if group is None:
            for old in [k for k in self._completions if k[0] < version - 4]:
                del self._completions[old]
                self._results.pop(old, None)
            group = self._completions[key] = make_completions(n, version, self.tokens)
        return group

    def result(self, version: int, n: int) -> rollout_pb2.GenerateResult:
        """The group as one request's result (no request id: the caller copies it and sets its own)."""
        key = (version, n)
        result = self._results.get(key)
        if result is None:
            group = self.completions(version, n)
            result = self._results[key] = rollout_pb2.GenerateResult(completions=group)
        return result


class StubEnv:
    """Prompts "p0", "p1", ... (train) and "e0", ... (eval); reward 1 for completion 0, else 0."""

    def __init__(self) -> None:
        self.cursor = 0

    async def sample(self, n: int, split: str, start: int | None = None) -> list[types_pb2.Prompt]:
        await asyncio.sleep(0)
        prefix = "e" if split == "eval" else "p"
        first = self.cursor if start is None else start
        if split != "eval":
            self.cursor = first + n
        return [types_pb2.Prompt(id=f"{prefix}{i}", text="1+1=") for i in range(first, first + n)]

    async def describe(self) -> EnvInfo:
        return EnvInfo("stub")  # single-turn

    async def score(self, prompt: types_pb2.Prompt, transcripts: Sequence[types_pb2.Transcript]) -> Scores:
        await asyncio.sleep(0)
        return self.scores(len(transcripts))

    @staticmethod
    @functools.cache
    def reward_infos(n: int) -> tuple[types_pb2.RewardInfo, ...]:
        return tuple(types_pb2.RewardInfo(ok=True) for _ in range(n))

    def scores(self, n: int) -> Scores:
        return Scores([1.0] + [0.0] * (n - 1), self.reward_infos(n), skip_group=False)

    async def evaluate(self, groups: Any) -> dict[str, float]:
        return {"eval/num_prompts": float(len(groups))}

    async def close(self) -> None:
        return None


class StubLearner:
    """Version = step, one per TrainStep; scores every token -1."""

    def __init__(self) -> None:
        self.version = 0

    async def state(self) -> LearnerInfo:
        await asyncio.sleep(0)
        return LearnerInfo(self.version, self.version, "grpo")

    async def train_step(self, batch: Batch) -> StepResult:
        await asyncio.sleep(0)
        self.version += 1
        return StepResult(self.version, self.version, {"loss": 0.5})

    async def prepare(
        self, kind: Any, receivers: Sequence[Any] = (), holders: Sequence[Any] | None = None
    ) -> PreparedWeights:
        await asyncio.sleep(0)
        message = types_pb2.WeightVersion(version=self.version, parent_version=self.version - 1)
        return PreparedWeights(self.version, message, 0.0)

    async def release(self, version: int) -> None:
        await asyncio.sleep(0)

    async def score_tokens(self, sequence: types_pb2.TokenSequence) -> TokenScores:
        await asyncio.sleep(0)
        return TokenScores([-1.0] * len(sequence.completion_token_ids), self.version)

    async def close(self) -> None:
        return None


class StubRollout:
    """Answers a generate on the loop's next turn, stamping `available[request_id]` as it does."""

    def __init__(
        self, address: str, max_in_flight: int, groups: GroupCache, available: dict[str, float]
    ) -> None:
        self.address, self.max_in_flight, self.groups = address, max_in_flight, groups
        self.available = available
        self.version = 0
        self.staged: int | None = None

    async def state(self) -> RolloutInfo:
        await asyncio.sleep(0)
        return RolloutInfo(self.address, self.version, True, self.max_in_flight, 1, self.address)

    async def generate(
        self, request_id: str, prompt: types_pb2.Prompt, sampling: Sampling
    ) -> list[types_pb2.Completion]:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        loop.call_soon(self._answer, answer, request_id, self.groups.completions(self.version, sampling.n))
        return await answer

    def _answer(self, answer: asyncio.Future, request_id: str, group: list[types_pb2.Completion]) -> None:
        if not answer.done():
            self.available[request_id] = time.perf_counter()
            answer.set_result(group)

    async def stage(
        self, weights: types_pb2.WeightVersion, deadline_s: float | None = None, rewind: bool = False
    ) -> int:
        await asyncio.sleep(0)
        self.staged = weights.version
        return weights.total_bytes

    async def commit(self, version: int, rewind: bool = False, deadline_s: float | None = None) -> None:
        await asyncio.sleep(0)
        if self.staged != version:
            raise RuntimeError(f"stub rollout {self.address}: v{version} is not staged")
        self.version, self.staged = version, None

    async def abort(self, version: int) -> None:
        self.staged = None

    async def score_tokens(self, sequence: types_pb2.TokenSequence) -> TokenScores:
        await asyncio.sleep(0)
        return TokenScores([-1.0] * len(sequence.completion_token_ids), self.version)

    async def close(self) -> None:
        return None


# ---- loopback: the same stubs behind the real protos, in a child process --------------------------------


class EnvServicer(env_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, env: StubEnv) -> None:
        self.env = env

    async def SamplePrompts(self, request, context):
        split = "eval" if request.split == env_pb2.SPLIT_EVAL else "train"
        start = request.start if request.HasField("start") else None
        prompts = await self.env.sample(request.n, split, start)
        return env_pb2.SamplePromptsResponse(prompts=prompts, next_position=self.env.cursor)

    async def DescribeEnvironment(self, request, context):
        return env_pb2.DescribeEnvironmentResponse(name="stub", max_turns=1)

    async def ScoreCompletions(self, request, context):
        scores = self.env.scores(len(request.transcripts) or len(request.completions))
        return env_pb2.ScoreCompletionsResponse(rewards=scores.rewards, reward_infos=scores.reward_infos)


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self, learner: StubLearner) -> None:
        self.learner = learner

    async def GetLearnerState(self, request, context):
        return learner_pb2.GetLearnerStateResponse(
            weight_version=self.learner.version, step=self.learner.version, loss="grpo"
        )

    async def TrainStep(self, request, context):
        result = await self.learner.train_step(None)  # type: ignore[arg-type]
        return learner_pb2.TrainStepResponse(
            result=types_pb2.StepResult(
                step=result.step, weight_version=result.weight_version, metrics=result.metrics
            )
        )

    async def PrepareWeights(self, request, context):
        prepared = await self.learner.prepare(request.transport)
        return learner_pb2.PrepareWeightsResponse(weight_version=prepared.message, prepare_ms=0.0)

    async def ReleaseWeights(self, request, context):
        return learner_pb2.ReleaseWeightsResponse()

    async def ScoreTokens(self, request, context):
        n = len(request.sequence.completion_token_ids)
        return learner_pb2.ScoreTokensResponse(logprobs=[-1.0] * n, weight_version=self.learner.version)


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    """Answers a GenerateBatch call's groups in one message; stamps `available[request_id]` as it
    yields it."""

    def __init__(self, rollout: StubRollout) -> None:
        self.rollout = rollout

    async def GenerateBatch(self, request, context):
        response = rollout_pb2.GenerateBatchResponse()
        for r in request.requests:
            result = response.results.add()
            result.CopyFrom(self.rollout.groups.result(self.rollout.version, r.sampling_params.n))
            result.request_id = r.request_id
        now = time.perf_counter()
        for r in request.requests:
            self.rollout.available[r.request_id] = now
        yield response

    async def GetRolloutState(self, request, context):
        r = self.rollout
        return rollout_pb2.GetRolloutStateResponse(
            rollout_id=r.address,
            weight_version=r.version,
            status=rollout_pb2.ROLLOUT_STATUS_READY,
            max_in_flight=r.max_in_flight,
            weight_workers=1,
            instance_id=r.address,
        )

    async def StageWeights(self, request, context):
        await self.rollout.stage(request.weight_version)
        return rollout_pb2.StageWeightsResponse(version=request.weight_version.version)

    async def CommitWeights(self, request, context):
        await self.rollout.commit(request.version)
        return rollout_pb2.CommitWeightsResponse(version=request.version)

    async def AbortWeights(self, request, context):
        await self.rollout.abort(request.version)
        return rollout_pb2.AbortWeightsResponse()

    async def ScoreTokens(self, request, context):
        n = len(request.sequence.completion_token_ids)
        return rollout_pb2.ScoreTokensResponse(logprobs=[-1.0] * n, weight_version=self.rollout.version)


async def _empty(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return b""


def _stub_process(conn: Any, rollouts: int, max_in_flight: int, tokens: int) -> None:
    """The child: serves the stubs until told to stop, then sends back the rollouts' stamps."""
    uvloop.run(_serve_stubs(conn, rollouts, max_in_flight, tokens))


async def _serve_stubs(conn: Any, rollouts: int, max_in_flight: int, tokens: int) -> None:
    available: dict[str, float] = {}
    groups = GroupCache(tokens)
    servers: list[grpc.aio.Server] = []

    async def serve(register) -> str:
        server = grpc.aio.server(options=grpc_options(CONTROL_MESSAGE_BYTES))
        register(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    def register_main(server: grpc.aio.Server) -> None:
        env_pb2_grpc.add_EnvironmentServiceServicer_to_server(EnvServicer(StubEnv()), server)
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(StubLearner()), server)
        empty = grpc.unary_unary_rpc_method_handler(_empty)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(EMPTY_SERVICE, {EMPTY_METHOD: empty}),)
        )

    main = await serve(register_main)
    addresses = []
    for _ in range(rollouts):
        holder: list[StubRollout] = []

        def register_rollout(server: grpc.aio.Server, holder: list[StubRollout] = holder) -> None:
            holder.append(StubRollout("", max_in_flight, groups, available))
            rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(holder[0]), server)

        address = await serve(register_rollout)
        holder[0].address = address
        addresses.append(address)
    conn.send({"main": main, "rollouts": addresses})
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)  # "stop"
    conn.send(available)
    await asyncio.gather(*(server.stop(None) for server in servers))


class StubProcess:
    """The loopback stubs' child process (spawned: no gRPC state crosses a fork)."""

    def __init__(self, rollouts: int, max_in_flight: int, tokens: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_stub_process, args=(child, rollouts, max_in_flight, tokens), daemon=True
        )
        self._process.start()
        child.close()
        addresses = self._conn.recv()
        self.main, self.rollouts = addresses["main"], addresses["rollouts"]

    def stop(self) -> dict[str, float]:
        """The rollouts' `available` stamps; the child exits."""
        self._conn.send("stop")
        available = self._conn.recv()
        self._process.join(30)
        return available

    def kill(self) -> None:
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


async def empty_rpc_baseline(address: str, calls: int) -> dict[str, float]:
    """An empty unary round trip to the stub process: p50 with one caller, rate with many."""
    async with open_channel(address) as channel:
        call = channel.unary_unary(f"/{EMPTY_SERVICE}/{EMPTY_METHOD}")
        for _ in range(100):
            await call(b"", timeout=30)
        rtts = []
        for _ in range(calls):
            started = time.perf_counter()
            await call(b"", timeout=30)
            rtts.append(time.perf_counter() - started)

        async def caller(n: int) -> None:
            for _ in range(n):
                await call(b"", timeout=30)

        per_caller = max(1, calls // EMPTY_CALLERS)
        started = time.perf_counter()
        await asyncio.gather(*(caller(per_caller) for _ in range(EMPTY_CALLERS)))
        elapsed = time.perf_counter() - started
    return {
        "empty_rtt_p50_us": statistics.median(rtts) * 1e6,
        "empty_rpc_per_s": per_caller * EMPTY_CALLERS / elapsed,
    }


# ---- driving the orchestrator ----------------------------------------------------------------------------


@dataclass
class Stamps:
    """perf_counter stamps by group id, and per step (TrainStep returned at, this process's CPU time
    then, completions trained)."""

    queued: dict[str, float] = field(default_factory=dict)
    batched: dict[str, float] = field(default_factory=dict)
    steps: list[tuple[float, float, int]] = field(default_factory=list)


class StampedQueue(asyncio.Queue):
    """The orchestrator's `scored` queue, stamping each group as it goes in and out."""

    def __init__(self, maxsize: int, stamps: Stamps) -> None:
        super().__init__(maxsize)
        self._stamps = stamps

    def put_nowait(self, item: Any) -> None:
        super().put_nowait(item)
        self._stamps.queued[item.group_id] = time.perf_counter()

    def get_nowait(self) -> Any:
        item = super().get_nowait()
        self._stamps.batched[item.group_id] = time.perf_counter()
        return item


def _time_train_steps(learner: Any, stamps: Stamps) -> None:
    train_step = learner.train_step

    async def timed(batch: Batch) -> StepResult:
        result = await train_step(batch)
        completions = sum(len(g.completions) for g in batch.groups)
        stamps.steps.append((time.perf_counter(), time.process_time(), completions))
        return result

    learner.train_step = timed


async def drive(args: argparse.Namespace, env: Any, learner: Any, pool: RolloutPool) -> tuple[Stamps, dict]:
    """One run of the real Orchestrator over these peers: warm-up + measured steps."""
    stamps = Stamps()
    with tempfile.TemporaryDirectory() as run_dir:
        settings = SchedulerSettings(
            group_size=args.group_size,
            groups_per_batch=args.groups_per_batch,
            max_staleness=args.max_staleness,
            max_steps=args.warmup_steps + args.steps,
            run_dir=Path(run_dir),
            rollout_addresses=[],
        )
        orchestrator = Orchestrator(settings, env, learner, pool)
        orchestrator.groups.scored = StampedQueue(orchestrator.groups.scored.maxsize, stamps)
        _time_train_steps(learner, stamps)
        await orchestrator.run()
        counts = orchestrator.ledger.counts()
    return stamps, counts


async def run_inproc(args: argparse.Namespace, rollouts: int) -> tuple[Stamps, dict, dict[str, float]]:
    available: dict[str, float] = {}
    groups = GroupCache(args.tokens)
    stubs = {
        f"stub-{i}": StubRollout(f"stub-{i}", args.max_in_flight, groups, available) for i in range(rollouts)
    }
    pool = RolloutPool(stubs.__getitem__)
    for address in stubs:
        pool.add(address)
    stamps, counts = await drive(args, StubEnv(), StubLearner(), pool)
    return stamps, counts, available


async def run_loopback(args: argparse.Namespace, stubs: StubProcess) -> tuple[Stamps, dict, dict[str, float]]:
    timeouts = TimeoutSettings()
    env, learner = GrpcEnvClient(stubs.main, timeouts), GrpcLearnerClient(stubs.main, timeouts)
    pool = RolloutPool(functools.partial(GrpcRolloutClient, timeouts=timeouts))
    for address in stubs.rollouts:
        pool.add(address)
    peers = [env, learner, *(h.client for h in pool.handles())]
    try:
        await asyncio.gather(*(peer.wait_ready(30) for peer in peers))
        stamps, counts = await drive(args, env, learner, pool)
    finally:
        await asyncio.gather(pool.close(), env.close(), learner.close())
    return stamps, counts, {}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1); nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(args: argparse.Namespace, stamps: Stamps, counts: dict, available: dict[str, float]) -> dict:
    steps = stamps.steps
    (start, cpu_start, _), (end, cpu_end, _) = steps[args.warmup_steps - 1], steps[-1]
    routed = sum(n for _, _, n in steps[args.warmup_steps :])
    groups = [g for g, at in stamps.queued.items() if at >= start and g in available]
    added = [(stamps.queued[g] - available[g]) * 1e3 for g in groups]
    to_batch = [(stamps.batched[g] - available[g]) * 1e3 for g in groups if g in stamps.batched]
    rate = routed / (end - start)
    p99 = percentile(added, 0.99)
    return {
        "completions_routed": routed,
        "seconds": end - start,
        "cpu_us_per_completion": (cpu_end - cpu_start) * 1e6 / routed,
        "completions_per_s": rate,
        "x_goal_rate": rate / GOAL_COMPLETIONS_PER_S,
        "groups_measured": len(added),
        "added_p50_ms": percentile(added, 0.5),
        "added_p99_ms": p99,
        "added_max_ms": max(added, default=math.nan),
        "x_goal_p99": p99 / GOAL_ADDED_P99_MS,
        "to_batch_p99_ms": percentile(to_batch, 0.99),
        "groups_dropped": counts["dropped"],
    }


def measure(args: argparse.Namespace, mode: str, rollouts: int) -> dict:
    row: dict[str, Any] = {"mode": mode, "rollouts": rollouts}
    if mode == "inproc":
        stamps, counts, available = uvloop.run(run_inproc(args, rollouts))
        row.update(summarize(args, stamps, counts, available))
        return row
    stubs = StubProcess(rollouts, args.max_in_flight, args.tokens)
    try:
        baseline = uvloop.run(empty_rpc_baseline(stubs.main, args.empty_calls))
        stamps, counts, _ = uvloop.run(run_loopback(args, stubs))
        available = stubs.stop()
    finally:
        stubs.kill()
    row.update(summarize(args, stamps, counts, available))
    row.update(baseline)
    groups_per_s = row["completions_per_s"] / args.group_size
    row["added_p99_in_rtts"] = row["added_p99_ms"] * 1e3 / baseline["empty_rtt_p50_us"]
    row["group_in_empty_rpcs"] = baseline["empty_rpc_per_s"] / groups_per_s
    return row


def measure_repeated(args: argparse.Namespace, mode: str, rollouts: int) -> dict:
    """`--repeats` runs of one configuration: the median of every number, and each run's numbers."""
    runs = [measure(args, mode, rollouts) for _ in range(args.repeats)]
    row = {
        k: statistics.median(r[k] for r in runs) if k not in ("mode", "rollouts") else v
        for k, v in runs[0].items()
    }
    row["runs"] = runs
    return row


def discard_service_logs() -> None:
    """Log as the service does (structlog JSON lines at INFO), into /dev/null: the cost stays."""
    sink = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 (the handler keeps it for the process)
    with contextlib.redirect_stderr(sink):
        configure_logging("INFO", "scheduler")


def print_table(rows: list[dict]) -> None:
    header = (
        f"{'mode':<9}{'rollouts':>8}{'compl/s':>10}{'x goal':>8}{'cpu us/compl':>13}"
        f"{'added p50':>11}{'added p99':>11}{'x goal':>8}{'to batch p99':>14}{'dropped':>9}"
    )
    print(
        f"goals: {GOAL_COMPLETIONS_PER_S:,.0f} completions/s in-process; added p99 <= {GOAL_ADDED_P99_MS} ms"
    )
    print(header)
    for r in rows:
        print(
            f"{r['mode']:<9}{r['rollouts']:>8}{r['completions_per_s']:>10,.0f}{r['x_goal_rate']:>8.2f}"
            f"{r['cpu_us_per_completion']:>13.1f}"
            f"{r['added_p50_ms']:>9.3f}ms{r['added_p99_ms']:>9.3f}ms{r['x_goal_p99']:>8.2f}"
            f"{r['to_batch_p99_ms']:>12.2f}ms{r['groups_dropped']:>9}"
        )
    for r in rows:
        if r["mode"] == "loopback":
            print(
                f"loopback {r['rollouts']:>3} rollouts: empty unary RTT p50 {r['empty_rtt_p50_us']:.0f} us, "
                f"{r['empty_rpc_per_s']:,.0f} empty RPC/s ({EMPTY_CALLERS} callers); "
                f"added p99 = {r['added_p99_in_rtts']:.1f} RTTs; one group = {r['group_in_empty_rpcs']:.1f} "
                "empty RPCs"
            )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rollouts", type=int, nargs="+", default=[1, 8, 64], help="rollout counts to run")
    parser.add_argument("--steps", type=int, default=300, help="measured training steps per run")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps before the measurement (>= 1)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--groups-per-batch", type=int, default=16, help="groups per step (B)")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--max-in-flight", type=int, default=256, help="what each stub rollout accepts")
    parser.add_argument("--tokens", type=int, default=8, help="completion tokens per completion")
    parser.add_argument("--empty-calls", type=int, default=2000, help="empty RPCs for the loopback baseline")
    parser.add_argument("--repeats", type=int, default=1, help="runs per configuration; medians are shown")
    parser.add_argument("--mode", choices=["inproc", "loopback", "both"], default="both")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if min(args.warmup_steps, args.steps, args.repeats) < 1:
        parser.error("--steps, --warmup-steps and --repeats must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    discard_service_logs()
    modes = ["inproc", "loopback"] if args.mode == "both" else [args.mode]
    rows = [measure_repeated(args, mode, n) for mode in modes for n in args.rollouts]
    report = {"config": {k: v for k, v in vars(args).items() if k != "json"}, "results": rows}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(rows)
    return report


if __name__ == "__main__":
    main()
