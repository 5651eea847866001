"""In-memory peers of the scheduler: the `EnvClient`, `LearnerClient` and `RolloutClient` protocols
(services/scheduler/peers/clients.py) without gRPC, with fault injection, so orchestration runs in ms.

They keep the contracts the real services keep (versions advance by one per step, a commit needs the
staged version, every token carries the version that produced it) and record what they were asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2
from services.common.errors import Aborted, FailedPrecondition, GrpoError, InvalidArgument, Unavailable
from services.scheduler.config import SchedulerSettings
from services.scheduler.orchestrator import Orchestrator
from services.scheduler.peers.clients import (
    Batch,
    EnvInfo,
    LearnerInfo,
    PreparedWeights,
    Rendered,
    RolloutInfo,
    Sampling,
    Scores,
    Split,
    StepResult,
    TokenScores,
)
from services.scheduler.peers.rollouts import RolloutPool
from services.transports import Receiver, TransportKind
from services.transports.cuda_ipc_fence import Holder


class FakeEnv:
    """Prompts "p0", "p1", ... (train, unbounded) and "e0".. (eval, `eval_size` of them). Reward 1.0 for
    completion index 0, else 0.0 (every group has variance). `fail_score(prompt_id)` may return an
    error to raise instead of scoring.

    Multi-turn (`max_turns` > 1): each episode's env turn is a user message "more <k>" until the
    episode has `turns_per_episode` model turns, then done; `reply(transcript)` may replace that."""

    def __init__(self, eval_size: int = 4, max_turns: int = 1, turns_per_episode: int = 2, **info) -> None:
        self.eval_size = eval_size
        self.cursor = 0
        self.scored: list[str] = []
        self.fail_score: Callable[[str], GrpoError | None] = lambda prompt_id: None
        self.info = EnvInfo("fake", max_turns=max_turns, **info)
        self.turns_per_episode = turns_per_episode
        self.responded: list[list[types_pb2.Transcript]] = []
        self.scored_transcripts: list[list[types_pb2.Transcript]] = []
        self.reply: Callable[[types_pb2.Transcript], env_pb2.EnvReply] | None = None
        self.fail_respond: Callable[[], GrpoError | None] = lambda: None

    async def describe(self) -> EnvInfo:
        return self.info

    async def respond(self, prompt: types_pb2.Prompt, transcripts: Sequence[types_pb2.Transcript]):
        error = self.fail_respond()
        if error is not None:
            raise error
        self.responded.append(list(transcripts))
        replies = []
        for transcript in transcripts:
            if self.reply is not None:
                replies.append(self.reply(transcript))
                continue
            turns = sum(1 for m in transcript.messages if m.role == "assistant")
            if turns >= self.turns_per_episode:
                replies.append(env_pb2.EnvReply(done=True))
            else:
                message = types_pb2.ChatMessage(role="user", content=f"more {turns}")
                replies.append(env_pb2.EnvReply(messages=[message], tool_calls=1))
        return replies

    async def sample(self, n: int, split: Split, start: int | None = None) -> list[types_pb2.Prompt]:
        if split == "eval":
            first = start or 0
            return [
                types_pb2.Prompt(id=f"e{i}", text=f"{i}+0=")
                for i in range(first, min(first + n, self.eval_size))
            ]
        first = self.cursor if start is None else start
        self.cursor = first + n
        return [types_pb2.Prompt(id=f"p{i}", text=f"{i}+1=") for i in range(first, first + n)]

    async def score(self, prompt: types_pb2.Prompt, transcripts: Sequence[types_pb2.Transcript]) -> Scores:
        error = self.fail_score(prompt.id)
        if error is not None:
            raise error
        self.scored.append(prompt.id)
        self.scored_transcripts.append(list(transcripts))
        rewards = [1.0 if i == 0 else 0.0 for i in range(len(transcripts))]
        infos = [types_pb2.RewardInfo(ok=not t.failure, failure=t.failure) for t in transcripts]
        return Scores(rewards, infos, skip_group=False)

    async def evaluate(self, groups) -> dict[str, float]:
        return {"eval/num_prompts": float(len(groups)), "eval/accuracy": 0.5}

    async def close(self) -> None:
        return None


class FakeLearner:
    """Version = step; `prepare` publishes the current version; scores every token -1.0 (a train
    step's logprobs: -instance, the process that trained it). A batch whose
    id is the last one trained is not trained again (as the real learner). Faults: `crash_before[s] = k`
    (dies when batch s arrives), `crash_after[s] = k` (trains batch s, dies before answering); either
    way it comes back `restart_delay` s later as a new process restored from its checkpoint at
    version k (same lineage), and every call while it is down is UNAVAILABLE."""

    def __init__(self, loss: str = "grpo") -> None:
        self.version = 0
        self.loss = loss
        self.alive = True
        self.instance = 1
        self.last_batch_id = ""
        self.crash_before: dict[int, int] = {}
        self.crash_after: dict[int, int] = {}
        self.restart_delay = 0.05
        self.batches: list[Batch] = []
        self.prepared: set[int] = set()
        self.released: list[int] = []
        self.receivers: list[tuple[Receiver, ...]] = []  # named to each prepare
        self.holders: list[tuple[Holder, ...] | None] = []  # vouched for in each prepare
        self.fail_prepare: list[GrpoError] = []  # raised by the next PrepareWeights calls
        self.checkpoints: set[int] = set()  # steps `restore` may go back to (besides 0)
        self.restores: list[tuple[int, int]] = []  # (from step, to step) of each restore
        self._stepped = asyncio.Condition()

    async def wait_for_version(self, version: int) -> None:
        async with self._stepped:
            await self._stepped.wait_for(lambda: self.version >= version)

    def _check_alive(self) -> None:
        if not self.alive:
            raise Unavailable("learner: connection refused")

    def _crash(self, restore_version: int) -> None:
        self.alive = False

        def restart() -> None:
            self.version, self.alive, self.instance = restore_version, True, self.instance + 1
            self.last_batch_id = f"step-{restore_version - 1}" if restore_version else ""
            self.prepared.clear()

        asyncio.get_running_loop().call_later(self.restart_delay, restart)

    async def state(self) -> LearnerInfo:
        self._check_alive()
        return LearnerInfo(
            self.version, self.version, self.loss, self.last_batch_id, "lineage-1", f"l{self.instance}"
        )

    async def train_step(self, batch: Batch) -> StepResult:
        self._check_alive()
        if batch.step in self.crash_before:
            self._crash(self.crash_before.pop(batch.step))
            raise Unavailable("learner: connection reset")
        if batch.batch_id == self.last_batch_id:
            return StepResult(self.version, self.version, {"duplicate": 1.0})
        if batch.step != self.version:
            raise FailedPrecondition(f"batch for step {batch.step}, learner at {self.version}")
        self.batches.append(batch)
        self.last_batch_id = batch.batch_id
        async with self._stepped:
            self.version += 1
            self._stepped.notify_all()
        if batch.step in self.crash_after:
            self._crash(self.crash_after.pop(batch.step))
            raise Unavailable("learner: connection reset")
        # every token's logprob names the process that trained it: -instance (a replay overwrites)
        logprobs = [
            [-float(self.instance)] * len(c.completion_token_ids) for g in batch.groups for c in g.completions
        ]
        return StepResult(self.version, self.version, {"loss": 0.5}, logprobs)

    async def prepare(
        self, kind: TransportKind, receivers: Sequence[Receiver] = (), holders: Sequence[Holder] | None = None
    ) -> PreparedWeights:
        self._check_alive()
        if self.fail_prepare:
            raise self.fail_prepare.pop(0)
        self.receivers.append(tuple(receivers))
        self.holders.append(None if holders is None else tuple(holders))
        self.prepared.add(self.version)
        message = types_pb2.WeightVersion(
            version=self.version, parent_version=self.version - 1, total_bytes=1000 + self.version
        )
        message.shared_memory.segment_name = f"fake_v{self.version}"
        return PreparedWeights(self.version, message, 0.1)

    async def release(self, version: int) -> None:
        self.prepared.discard(version)
        self.released.append(version)

    async def score_tokens(self, sequence: types_pb2.TokenSequence) -> TokenScores:
        self._check_alive()
        return TokenScores([-1.0] * len(sequence.completion_token_ids), self.version)

    async def restore(self, lineage_id: str, max_step: int, min_step: int = 0) -> int:
        """As the real learner: back to the newest of `checkpoints` at or before `max_step` (step 0
        when none), refused for another lineage or below `min_step`; recorded in `restores`."""
        self._check_alive()
        if lineage_id != "lineage-1":
            raise FailedPrecondition(f"this learner is of lineage lineage-1, not {lineage_id}")
        previous = self.version
        if previous > max_step:
            target = max((c for c in self.checkpoints if c <= max_step), default=0)
            if target < min_step:
                raise FailedPrecondition(f"no checkpoint between steps {min_step} and {max_step}")
            self.version, self.last_batch_id = target, f"step-{target - 1}" if target else ""
            self.prepared.clear()
            self.restores.append((previous, target))
        return previous

    async def close(self) -> None:
        return None


@dataclass
class FakeRollout:
    """One rollout worker. Faults: `alive=False` (every call UNAVAILABLE), `fail_stage` (errors raised by
    the next StageWeights calls), `stale_groups` (that many training groups stamped two versions older
    than the loaded one), `logprob_offset` (misaligned scoring), `gate` (generation waits for it),
    `on_probe` (awaited by every ScoreTokens; what it returns is added to the logprobs)."""

    address: str
    rollout_id: str = ""
    version: int = 0
    max_in_flight: int = 4
    alive: bool = True
    fail_stage: list[GrpoError] = field(default_factory=list)
    stale_groups: int = 0
    logprob_offset: float = 0.0
    gate: asyncio.Event | None = None
    on_probe: Callable[[FakeRollout], Awaitable[float]] | None = None
    staged: int | None = None
    generated_at: list[int] = field(default_factory=list)  # the loaded version at each generate
    sampled: list[tuple[str, Sampling]] = field(default_factory=list)  # (request id, sampling) of each
    worked: asyncio.Event = field(default_factory=asyncio.Event)  # set by the first training generate
    commits: list[int] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)
    token_in: list[list[int]] = field(default_factory=list)  # each generate's prompt_token_ids

    def __post_init__(self) -> None:
        self.rollout_id = self.rollout_id or self.address

    def _check_alive(self) -> None:
        if not self.alive:
            raise Unavailable(f"rollout {self.address}: connection refused")

    async def state(self) -> RolloutInfo:
        self._check_alive()
        return RolloutInfo(self.rollout_id, self.version, True, self.max_in_flight, 1, f"{self.rollout_id}-1")

    async def render_bridge(
        self, messages: Sequence[types_pb2.ChatMessage], previous_tail: Sequence[int], tools_json: str = ""
    ) -> Rendered:
        """Two tokens per message (9, 9); a message "violate" cannot be appended (a prefix violation)."""
        self._check_alive()
        if any(m.content == "violate" for m in messages):
            raise InvalidArgument("template is not prefix-preserving for these messages")
        return Rendered([9, 9] * len(messages), "".join(f"<{m.content}>" for m in messages))

    async def generate(
        self,
        request_id: str,
        prompt: types_pb2.Prompt,
        sampling: Sampling,
        prompt_token_ids: Sequence[int] = (),
    ) -> list[types_pb2.Completion]:
        self._check_alive()
        self.token_in.append(list(prompt_token_ids))
        if self.gate is not None:
            await self.gate.wait()
            self._check_alive()
        self.generated_at.append(self.version)
        self.sampled.append((request_id, sampling))
        if not request_id.startswith("probe"):
            self.worked.set()
        stamp = self.version
        if self.stale_groups and not request_id.startswith("probe"):
            self.stale_groups -= 1
            stamp -= 2
        return [
            types_pb2.Completion(
                prompt_id=prompt.id,
                index=i,
                prompt_token_ids=[] if prompt_token_ids else [1, 2],
                completion_token_ids=[3, 4, 5],
                logprobs=[-1.0, -1.0, -1.0],
                version_spans=[types_pb2.WeightVersionSpan(version=stamp, start=0, end=3)],
                text=str(i),
                rollout_id=self.rollout_id,
            )
            for i in range(sampling.n)
        ]

    async def stage(
        self, weights: types_pb2.WeightVersion, deadline_s: float | None = None, rewind: bool = False
    ) -> int:
        self._check_alive()
        if self.fail_stage:
            raise self.fail_stage.pop(0)
        if weights.version <= self.version and not rewind:  # as the real rollout refuses it
            raise Aborted(f"weight version {weights.version} is not newer than the loaded {self.version}")
        self.staged = weights.version
        return weights.total_bytes

    async def commit(self, version: int, rewind: bool = False, deadline_s: float | None = None) -> None:
        self._check_alive()
        if version < self.version and not rewind:
            raise Aborted(f"v{version} is older than the loaded v{self.version}")
        if self.staged != version:
            raise FailedPrecondition(f"v{version} is not staged")
        self.version, self.staged = version, None
        self.commits.append(version)

    async def abort(self, version: int) -> None:
        self._check_alive()
        self.aborts.append(version)
        self.staged = None

    async def score_tokens(self, sequence: types_pb2.TokenSequence) -> TokenScores:
        self._check_alive()
        n = len(sequence.completion_token_ids)
        offset = self.logprob_offset + (await self.on_probe(self) if self.on_probe else 0.0)
        return TokenScores([-1.0 + offset] * n, self.version)

    async def close(self) -> None:
        return None


@dataclass
class Cluster:
    """A scheduler wired to fakes: `orchestrator`, `env`, `learner`, `rollouts` by address."""

    orchestrator: Orchestrator
    env: FakeEnv
    learner: FakeLearner
    rollouts: dict[str, FakeRollout]

    def add_rollout(self, rollout: FakeRollout) -> None:
        self.rollouts[rollout.address] = rollout
        self.orchestrator.register_rollout(rollout.address)

    async def run(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109 (a test's hard limit)
        await asyncio.wait_for(self.orchestrator.run(), timeout)


def cluster(
    run_dir: Path,
    *rollouts: FakeRollout,
    env: FakeEnv | None = None,
    learner: FakeLearner | None = None,
    **settings,
) -> Cluster:
    """Fakes + an Orchestrator over them; `settings` override small, fast SchedulerSettings. Passing
    the `env` and `learner` of an earlier cluster restarts a scheduler against the same peers."""
    base = dict(
        group_size=2,
        groups_per_batch=2,
        max_steps=3,
        max_staleness=1,
        run_dir=run_dir,
        health_interval_seconds=0.01,
        prompt_buffer=8,
        weight_transport="shared_memory",
        rollout_addresses=[],
        recovery={"retry_interval": 0.01, "retry_max_interval": 0.05, "ledger_flush_interval": 0.01},
    )
    config = SchedulerSettings(**{**base, **settings})
    env, learner = env or FakeEnv(), learner or FakeLearner()
    by_address = {r.address: r for r in rollouts}
    pool = RolloutPool(lambda address: by_address[address])
    for rollout in rollouts:
        pool.add(rollout.address)
    return Cluster(Orchestrator(config, env, learner, pool), env, learner, by_address)
