"""The group pipeline: train prompts in, scored groups out.

    feeder ──prompts──▶ dispatcher ──(a task per group)──▶ generate (rollout) ▶ score (env) ──scored──▶
                                                         (▶ later turns: env ⇄ rollout, episodes.py)

The feeder draws prompts from the env's train stream at positions the scheduler owns (`cursor`: the
env's own cursor, lost when it restarts, never matters, and the ledger restores ours). With the
curriculum on (`curriculum.py`), it draws each prompt's level first and then from that level's own
stream (`level_cursors`), whose positions map into the same train-position space. The
dispatcher admits a group only to a rollout whose weights keep it within the staleness bound
(`policy.expected_train_version`), records it in the ledger and runs it as its own task. A group
that fails is dropped and its prompt, keeping its position, goes back to the front (`reissue`); an
env that is down (restarting) is waited for, so scored work is never thrown away. With dynamic
sampling, a group whose rewards have zero variance is filtered here and never reaches a batch.
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from functools import partial

from grpo.common.v1 import types_pb2
from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.ledger.group_ledger import GroupLedger, GroupState
from services.scheduler.ledger.store import LedgerStore
from services.scheduler.observe.metrics import TokenRate
from services.scheduler.observe.timeline import SCORE, Timeline
from services.scheduler.peers.clients import EnvClient, Sampling, ScoredGroup
from services.scheduler.peers.patience import patiently
from services.scheduler.peers.placement import credits_taken
from services.scheduler.peers.rollouts import RolloutHandle, RolloutPool, abandonable
from services.scheduler.pipeline.curriculum import LEVEL_KEY, LevelStats, level_cursors, level_position
from services.scheduler.pipeline.episodes import EnvTurnFailed, EpisodeRunner, model_tokens, transcripts_of
from services.scheduler.pipeline.policy import expected_train_version, hoist_facts, span_versions

log = get_logger(__name__)

# A prompt whose group failed this many times is given up (logged and counted as dropped).
MAX_ATTEMPTS = 5

_BY_INDEX = operator.attrgetter("index")

# A train prompt and its position in the env's train stream (re-issued prompts keep theirs).
Drawn = tuple[int, types_pb2.Prompt]


class GroupPipeline:
    """Prompt buffer, re-issue queue, dispatcher and group tasks; `scored` is what the trainer batches."""

    def __init__(
        self,
        settings: SchedulerSettings,
        env: EnvClient,
        pool: RolloutPool,
        ledger: GroupLedger,
        store: LedgerStore,
        version: Callable[[], int],
        generation: Callable[[], int],
        timeline: Timeline | None = None,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.settings = settings
        self.episodes = episodes or EpisodeRunner(settings, env)
        self.timeline = timeline or Timeline()
        self.env, self.pool, self.ledger, self.store = env, pool, ledger, store
        self._version, self._generation = version, generation
        self.prompts: asyncio.Queue[Drawn] = asyncio.Queue(maxsize=settings.prompt_buffer)
        self._prompt_chunk = min(settings.prompt_buffer, max(1, settings.groups_per_batch))
        self._prompt_room = asyncio.Event()  # set when the buffer has room for another chunk
        self.cursor = 0  # the next train-stream position to draw
        self.levels: LevelStats | None = None  # an env with difficulty levels (set once it is described)
        self.level_cursors: dict[str, int] = {}  # the curriculum's next position in each level's stream
        self.reissue: deque[Drawn] = deque()
        batch = settings.groups_per_batch
        self.scored: asyncio.Queue[ScoredGroup] = asyncio.Queue(maxsize=(settings.max_staleness + 1) * batch)
        self.filtered = 0  # groups filtered (dynamic sampling) since the trainer last took the count
        self.tokens = TokenRate()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.tasks: set[asyncio.Task] = set()
        s = settings.sampling
        self.sampling = Sampling(
            n=settings.group_size,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
        )

    @property
    def cost(self) -> int:
        """Rollout credits a group takes: one request (n = G), or G for a multi-turn task's episodes."""
        return self.settings.group_size if self.episodes.multi_turn else 1

    def resume_at(self, cursor: int, reissue: Iterable[Drawn] = ()) -> None:
        """Continue the train stream at `cursor`, the prompts of `reissue` first (a restart's plan)."""
        self.cursor = cursor
        self.reissue.extend(reissue)

    def resume_levels(self, positions: Iterable[int]) -> None:
        """Continue each level's stream after the positions the ledger's groups took (a restart)."""
        if self.levels is not None:
            self.level_cursors = level_cursors(self.levels.levels, positions)

    def take_filtered(self) -> int:
        """Groups filtered (dynamic sampling) since the last call."""
        filtered, self.filtered = self.filtered, 0
        return filtered

    def queue_depths(self) -> dict[str, int]:
        """Prompts fetched ahead, prompts to issue again, scored groups waiting for a batch."""
        return {"prompts": self.prompts.qsize(), "reissue": len(self.reissue), "scored": self.scored.qsize()}

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def pause(self, paused: bool) -> None:
        """Stop (or restart) issuing new groups; in-flight groups still finish."""
        if paused:
            self._resumed.clear()
        else:
            self._resumed.set()

    async def feed(self) -> None:
        """Keep up to `prompt_buffer` prompts fetched ahead, refilled a chunk (one env call) at a time:
        the feeder wakes once per chunk taken, not once per prompt.

        The scheduler owns the train cursor: every draw names its start, so the env's own cursor (lost
        when it restarts) never matters, and the ledger restores ours."""
        chunk = self._prompt_chunk
        while True:
            while self.prompts.maxsize - self.prompts.qsize() >= chunk:
                curriculum = self.levels is not None and self.levels.drawing
                for drawn in await (self._draw_levels(chunk) if curriculum else self._draw(chunk)):
                    await self.prompts.put(drawn)
            self._prompt_room.clear()
            await self._prompt_room.wait()

    async def _draw(self, n: int) -> list[Drawn]:
        """`n` prompts of the env's train stream, at the cursor."""
        start = self.cursor
        prompts = await patiently(
            self.settings.recovery, "env", partial(self.env.sample, n, "train", start=start)
        )
        self.cursor = start + len(prompts)
        if self.levels is not None:
            self.levels.served(p.metadata.get(LEVEL_KEY, "") for p in prompts)
        return [(start + offset, prompt) for offset, prompt in enumerate(prompts)]

    async def _draw_levels(self, n: int) -> list[Drawn]:
        """`n` prompts, each from the level the curriculum draws for it (one env call per level)."""
        assert self.levels is not None
        picks = self.levels.draw(n)
        fetched: dict[str, deque[Drawn]] = {}
        for level, count in Counter(picks).items():
            start = self.level_cursors.get(level, 0)
            prompts = await patiently(
                self.settings.recovery, "env",
                partial(self.env.sample, count, "train", start=start, level=level),
            )  # fmt: skip
            self.level_cursors[level] = start + len(prompts)
            fetched[level] = deque(
                (level_position(self.levels.levels, level, start + i), p) for i, p in enumerate(prompts)
            )
        return [fetched[level].popleft() for level in picks]

    async def _next_prompt(self) -> Drawn:
        if self.reissue:
            return self.reissue.popleft()
        drawn = await self.prompts.get()
        if self.prompts.maxsize - self.prompts.qsize() >= self._prompt_chunk:
            self._prompt_room.set()
        return drawn

    async def dispatch(self) -> None:
        cfg = self.settings
        while True:
            await self._resumed.wait()
            handle = await self.pool.acquire(
                lambda: expected_train_version(
                    self._version(), self.ledger.in_pipeline(), cfg.groups_per_batch
                ),
                cfg.max_staleness,
                self.cost,
            )
            position, prompt = await self._next_prompt()
            record = self.ledger.issue(
                prompt.id, self._version(), position, self._generation(), rollout_id=handle.name
            )
            if record.attempt == 0:
                self.store.prompt_issued(position, prompt)
            task = asyncio.create_task(self._run_group(record.group_id, prompt, handle))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            await asyncio.sleep(0)

    async def _run_group(self, group_id: str, prompt: types_pb2.Prompt, handle: RolloutHandle) -> None:
        """Generate (rollout; a multi-turn task's later turns with the env) → score (env) → queue for
        training. Failures drop the group; retryable ones re-issue its prompt, and only a rollout
        failure counts against the rollout."""
        started = time.perf_counter()
        try:
            completions, versions, tokens = await self._generate(group_id, prompt, handle)
            transcripts, turn_rewards, stats = transcripts_of(completions), None, None
            if self.episodes.multi_turn:  # the rollout stays this group's until its episodes end
                completions, transcripts, turn_rewards, stats = await self.episodes.run(
                    group_id, prompt, completions, handle, self.sampling
                )
                versions, tokens = span_versions(completions), model_tokens(completions)
        except EnvTurnFailed as exc:
            self.fail(group_id, prompt, "env", exc.__cause__ if isinstance(exc.__cause__, GrpoError) else exc)
            return
        except GrpoError as exc:
            if exc.unreachable:
                await self.pool.mark(handle, healthy=False)
            self.fail(group_id, prompt, f"rollout {handle.name}", exc)
            return
        except Exception as exc:  # a broken answer from the rollout: log it, never lose the prompt
            log.exception("rollout returned an unusable group", group=group_id, rollout=handle.name)
            self.fail(group_id, prompt, f"rollout {handle.name}", exc)
            return
        finally:  # the rollout is free as soon as generation ends
            await self.pool.release(handle, credits_taken(handle, self.cost))
        generated = time.perf_counter()
        self.ledger.advance(group_id, GroupState.GENERATED, versions=versions)
        self.tokens.add(tokens)
        self.timeline.async_span(
            f"generate {handle.name}", "generate", group_id, started, generated,
            group=group_id, versions=sorted(versions), tokens=tokens,
        )  # fmt: skip
        try:  # an env that went away (restarting) is waited for: the completions are kept
            scores = await patiently(
                self.settings.recovery, "env", lambda: self.env.score(prompt, transcripts)
            )
        except GrpoError as exc:
            self.fail(group_id, prompt, "env", exc)
            return
        self.timeline.async_span(SCORE, "score", group_id, generated, time.perf_counter(), group=group_id)
        if scores.skip_group:  # the env's failure policy: a reward could not be computed
            reasons = "; ".join(i.failure for i in scores.reward_infos if not i.ok)
            self.drop(group_id, f"scoring failed: {reasons}")
            return
        rewards = list(scores.rewards)
        if turn_rewards is not None:  # per-turn rewards add to the episode's score
            rewards = [
                r + t if i.ok else r
                for r, t, i in zip(rewards, turn_rewards, scores.reward_infos, strict=True)
            ]
        level = prompt.metadata.get(LEVEL_KEY)
        if self.levels is not None and level:  # before filtering: a solved-by-all group is evidence
            self.store.level_outcome(group_id, level, *self.levels.observe_rewards(level, rewards))
        if self.settings.dynamic_sampling and max(rewards) - min(rewards) <= 0.0:
            self.ledger.advance(group_id, GroupState.FILTERED, "zero reward variance (dynamic sampling)")
            self.filtered += 1
            await self.pool.notify()  # it left the pipeline: admission may let another group in
            return
        self.ledger.advance(group_id, GroupState.SCORED)
        prompt_ids, sampling, rollout_id = hoist_facts(completions)
        group = ScoredGroup(
            group_id, prompt, completions, rewards, scores.reward_infos, versions, stats or {},
            prompt_ids, sampling, rollout_id,
        )  # fmt: skip
        self.store.scored(group)
        await self.scored.put(group)

    async def _generate(
        self, group_id: str, prompt: types_pb2.Prompt, handle: RolloutHandle
    ) -> tuple[list[types_pb2.Completion], set[int], int]:
        """The group in index order, checked (indices 0..G-1, tokens stamped with weight versions), with
        the versions that produced it and its completion-token count: read once, here."""
        completions = sorted(
            await abandonable(handle, handle.client.generate(group_id, prompt, self.sampling)), key=_BY_INDEX
        )
        versions: set[int] = set()
        tokens = 0
        complete = len(completions) == self.settings.group_size
        for i, c in enumerate(completions):  # one pass: every field read here is read once per group
            if c.index != i:
                complete = False
                break
            tokens += len(c.completion_token_ids)
            for span in c.version_spans:
                versions.add(span.version)
        if not complete:
            indices = [c.index for c in completions]
            raise RuntimeError(f"group {group_id}: rollout returned completion indices {indices}")
        if not versions:
            raise ValueError(f"group {group_id}: completions carry no weight-version spans")
        return completions, versions, tokens

    def fail(self, group_id: str, prompt: types_pb2.Prompt, where: str, exc: Exception) -> None:
        """Drop the group; re-issue its prompt unless the failure says the request itself is bad."""
        if isinstance(exc, GrpoError):
            retry, reason = exc.retryable, f"{where}: {exc}"
        else:
            retry, reason = True, f"{where}: {type(exc).__name__}: {exc}"
        retry = retry and self.ledger.get(group_id).attempt + 1 < MAX_ATTEMPTS
        log.warning("group failed", group=group_id, reason=reason, reissue=retry)
        self.drop(group_id, reason, prompt if retry else None)

    def drop(self, group_id: str, reason: str, reissue: types_pb2.Prompt | None = None) -> None:
        """Drop a live group; with `reissue`, its prompt goes back to the queue (same position)."""
        record = self.ledger.get(group_id)
        if record.state in (GroupState.TRAINED, GroupState.DROPPED, GroupState.FILTERED):
            return
        if self.settings.source == "external":  # its harness owns its task: nothing to issue again
            reissue = None
        self.ledger.advance(group_id, GroupState.DROPPED, reason, reissue=reissue is not None)
        if reissue is not None:
            self.reissue.append((record.position, reissue))
