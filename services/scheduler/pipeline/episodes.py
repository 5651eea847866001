"""Episodes: the G episodes of one prompt, driven turn by turn in token space.

    turn 1   Generate(prompt, n=G)                 the group's first model turns (as single-turn)
    then, while an episode is live and under max_turns:
             Respond(prompt, live transcripts)     env: tool results / a user message / done (one call)
             RenderMessages(BRIDGE, messages)      rollout: those messages as tokens after the model's
             Generate(token-in, n=1 per episode)   the next model turn continues the exact tokens

A single-turn task is the one-turn case: its episodes end after turn 1 without a Respond call.

**Token-in, token-out.** An episode is one token sequence that only ever grows: the prompt's tokens,
then each model turn's sampled tokens exactly as sampled (with their behaviour logprobs and weight
versions), then each environment turn's tokens as the rollout rendered *only the new messages*
(`render_bridge`), never a re-tokenization of text. Every turn's prompt is therefore an exact
prefix-extension of the previous turn's prompt + completion by construction. Where a chat template
cannot append the messages that way (the rollout refuses the bridge), that is a **prefix violation**:
counted (`episode/prefix_violations`) and the episode ends as a failure with the reason; it is never
re-rendered, so never trained on tokens that were not sampled.

**Failures.** An episode that runs past the env's `episode_timeout`, would exceed its token budget
(`max_episode_tokens`, or the rollout's `max_model_len` for the next turn), or whose environment turn
fails (the env raised, timed out, answered garbage) ends there with the reason in its transcript's
`failure`; scoring reports it as a failure of kind "episode" and the env's failure policy applies
(skip the group, or the failure reward). The run goes on. An env that is down is waited for
(`patiently`: Respond is stateless, so asking again is safe); a rollout that fails fails the whole
group, whose prompt is issued again: no episode is ever trained half.

Each episode becomes one `Completion` (its `turns` mark model and environment tokens; environment
tokens have logprob 0 and no version span, and are masked out of the loss) and one `Transcript` (what
the environment scores).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2
from services.common.errors import GrpoError
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.peers.clients import EnvClient, EnvInfo, Rendered, Sampling
from services.scheduler.peers.patience import patiently
from services.scheduler.peers.placement import credits_taken
from services.scheduler.peers.rollouts import RolloutHandle, abandonable

log = get_logger(__name__)

MODEL, ENV = types_pb2.TURN_SOURCE_MODEL, types_pb2.TURN_SOURCE_ENV
# The previous model turn's last tokens sent with a bridge: enough to see its end of turn.
TAIL = 8


class EnvTurnFailed(Exception):
    """The environment could not be asked for its turn (it stayed away past the recovery timeout):
    the group fails because of the env, not the rollout."""


@dataclass
class Episode:
    """One episode's token sequence after the prompt, its turns and its transcript, as it grows."""

    index: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[types_pb2.WeightVersionSpan] = field(default_factory=list)
    turns: list[types_pb2.Turn] = field(default_factory=list)
    messages: list[types_pb2.ChatMessage] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    done: bool = False
    failure: str = ""
    turn_reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0

    @property
    def live(self) -> bool:
        return not self.done and not self.failure

    @property
    def model_turns(self) -> int:
        return sum(1 for t in self.turns if t.source == MODEL)

    def context(self) -> list[int]:
        """The next model turn's prompt: every token so far."""
        return self.prompt_ids + self.tokens

    def add_model_turn(self, c: types_pb2.Completion) -> None:
        offset = len(self.tokens)
        self.tokens.extend(c.completion_token_ids)
        self.logprobs.extend(c.logprobs)
        for span in c.version_spans:  # the rollout's spans cover its turn from 0
            self.spans.append(
                types_pb2.WeightVersionSpan(
                    version=span.version, start=offset + span.start, end=offset + span.end
                )
            )
        self.turns.append(
            types_pb2.Turn(source=MODEL, start=offset, end=len(self.tokens), finish_reason=c.finish_reason)
        )
        self.messages.append(types_pb2.ChatMessage(role="assistant", content=c.text))
        self.text.append(c.text)

    def add_env_turn(
        self, messages: Sequence[types_pb2.ChatMessage], rendered: Rendered, reward: float | None
    ) -> None:
        offset = len(self.tokens)
        self.tokens.extend(rendered.token_ids)
        self.logprobs.extend([0.0] * len(rendered.token_ids))
        turn = types_pb2.Turn(source=ENV, start=offset, end=len(self.tokens))
        if reward is not None:
            turn.reward = reward
        self.turns.append(turn)
        self.messages.extend(messages)
        self.text.append(rendered.text)

    def fail(self, reason: str) -> None:
        if self.live:
            self.failure = reason

    def completion(self, first: types_pb2.Completion) -> types_pb2.Completion:
        """The episode as one completion (the first turn's per-request facts kept)."""
        out = types_pb2.Completion(
            prompt_id=first.prompt_id,
            index=self.index,
            prompt_token_ids=self.prompt_ids,
            completion_token_ids=self.tokens,
            logprobs=self.logprobs,
            finish_reason=self.turns[-1].finish_reason if self.turns else first.finish_reason,
            version_spans=self.spans,
            text="".join(self.text),
            rollout_id=first.rollout_id,
            turns=self.turns,
        )
        out.sampling_params.CopyFrom(first.sampling_params)
        return out

    def transcript(self) -> types_pb2.Transcript:
        return types_pb2.Transcript(messages=self.messages, failure=self.failure)


@dataclass
class EpisodeCounts:
    """Run-wide episode counters (GetStatus and every step row carry them)."""

    prefix_violations: int = 0
    failures: int = 0


def transcripts_of(completions: Sequence[types_pb2.Completion]) -> list[types_pb2.Transcript]:
    """Single-turn completions as the env scores them: one assistant message each."""
    return [
        types_pb2.Transcript(messages=[types_pb2.ChatMessage(role="assistant", content=c.text)])
        for c in completions
    ]


def model_tokens(completions: Sequence[types_pb2.Completion]) -> int:
    """Tokens the model sampled (environment turns excluded)."""
    total = 0
    for c in completions:
        if c.turns:
            total += sum(t.end - t.start for t in c.turns if t.source == MODEL)
        else:
            total += len(c.completion_token_ids)
    return total


def episode_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """A group's episode figures (summed over its episodes; the step row turns them into rates)."""
    return {
        "episodes": float(len(episodes)),
        "model_turns": float(sum(e.model_turns for e in episodes)),
        "tool_calls": float(sum(e.tool_calls for e in episodes)),
        "tool_errors": float(sum(e.tool_errors for e in episodes)),
        "episodes_with_tool_calls": float(sum(1 for e in episodes if e.tool_calls)),
        # at least one call that ran (well-formed, a known tool, valid arguments, no error)
        "episodes_with_valid_calls": float(sum(1 for e in episodes if e.tool_calls > e.tool_errors)),
        "failures": float(sum(1 for e in episodes if e.failure)),
        "env_tokens": float(sum(t.end - t.start for e in episodes for t in e.turns if t.source == ENV)),
    }


class EpisodeRunner:
    """Runs a group's later turns (after its first Generate) against one rollout and the env."""

    def __init__(self, settings: SchedulerSettings, env: EnvClient, info: EnvInfo | None = None) -> None:
        self.settings, self.env = settings, env
        self.info = info or EnvInfo()
        self.counts = EpisodeCounts()

    @property
    def multi_turn(self) -> bool:
        return self.info.max_turns > 1

    async def run(
        self,
        request_id: str,
        prompt: types_pb2.Prompt,
        first: Sequence[types_pb2.Completion],
        handle: RolloutHandle,
        sampling: Sampling,
    ) -> tuple[list[types_pb2.Completion], list[types_pb2.Transcript], list[float], dict[str, float]]:
        """The group's episodes from its first turns (in index order): completions, transcripts, each
        episode's per-turn reward sum, and the group's episode figures."""
        prompt_ids = list(first[0].prompt_token_ids)
        episodes = [Episode(c.index, prompt_ids) for c in first]
        for episode, completion in zip(episodes, first, strict=True):
            episode.add_model_turn(completion)
        deadline = self.info.episode_timeout
        try:
            async with asyncio.timeout(deadline or None):
                await self._later_turns(request_id, prompt, episodes, handle, sampling)
        except TimeoutError:
            for episode in episodes:
                episode.fail(f"episode deadline: not over after {deadline:g}s")
        for episode in episodes:
            if episode.failure:
                self.counts.failures += 1
                log.info("episode failed", request=request_id, episode=episode.index, reason=episode.failure)
        completions = [e.completion(c) for e, c in zip(episodes, first, strict=True)]
        return (
            completions,
            [e.transcript() for e in episodes],
            [e.turn_reward for e in episodes],
            episode_stats(episodes),
        )

    async def _later_turns(
        self,
        request_id: str,
        prompt: types_pb2.Prompt,
        episodes: list[Episode],
        handle: RolloutHandle,
        sampling: Sampling,
    ) -> None:
        turn_sampling = Sampling(
            n=1, temperature=sampling.temperature, max_tokens=sampling.max_tokens,
            top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
        )  # fmt: skip
        # at most the credits the group holds: all G at once, or the rollout's max_in_flight
        at_once = asyncio.Semaphore(credits_taken(handle, len(episodes)))
        for turn in range(2, self.info.max_turns + 1):
            live = [e for e in episodes if e.live]
            if not live:
                return
            started = time.perf_counter()
            try:
                replies = await patiently(
                    self.settings.recovery,
                    "env",
                    lambda live=live: self.env.respond(prompt, [e.transcript() for e in live]),
                )
            except GrpoError as exc:
                raise EnvTurnFailed(str(exc)) from exc
            if len(replies) != len(live):
                raise RuntimeError(f"env answered {len(replies)} of {len(live)} episodes")
            going: list[Episode] = []
            for episode, reply in zip(live, replies, strict=True):
                episode.tool_calls += reply.tool_calls
                episode.tool_errors += reply.tool_errors
                if reply.HasField("reward"):
                    episode.turn_reward += reply.reward
                if reply.failure:
                    episode.fail(f"environment: {reply.failure}")
                elif reply.done:
                    episode.done = True
                else:
                    going.append(episode)
            await asyncio.gather(
                *(self._bridge(e, r, handle, prompt.tools_json) for e, r in _replies(going, live, replies))
            )
            going = [
                e for e in going if e.live and self._fits(e, turn_sampling.max_tokens, handle.max_model_len)
            ]
            if not going:
                return

            async def next_turn(e: Episode, turn: int = turn) -> list[types_pb2.Completion]:
                async with at_once:
                    call = handle.client.generate(
                        f"{request_id}/{e.index}/t{turn}", prompt, turn_sampling, e.context()
                    )
                    return await abandonable(handle, call)

            generated = await asyncio.gather(*(next_turn(e) for e in going))
            for episode, completions in zip(going, generated, strict=True):
                if len(completions) != 1:
                    where = f"{request_id}: turn {turn} of episode {episode.index}"
                    raise RuntimeError(f"{where}: {len(completions)} completions")
                episode.add_model_turn(completions[0])
            log.debug(
                "turn",
                request=request_id,
                turn=turn,
                episodes=len(going),
                ms=(time.perf_counter() - started) * 1e3,
            )

    async def _bridge(
        self, episode: Episode, reply: env_pb2.EnvReply, handle: RolloutHandle, tools_json: str
    ) -> None:
        """Append the env's messages as tokens; a template that cannot is a prefix violation."""
        try:
            rendered = await handle.client.render_bridge(reply.messages, episode.tokens[-TAIL:], tools_json)
        except GrpoError as exc:
            if exc.retryable:
                raise  # the rollout, not the template: the group fails and is issued again
            self.counts.prefix_violations += 1
            episode.fail(f"prefix violation: the chat template cannot append the environment's turn: {exc}")
            return
        if not rendered.token_ids:
            self.counts.prefix_violations += 1
            episode.fail("prefix violation: the environment's turn rendered to no tokens")
            return
        episode.add_env_turn(reply.messages, rendered, reply.reward if reply.HasField("reward") else None)

    def _fits(self, episode: Episode, max_tokens: int, max_model_len: int) -> bool:
        """Whether another model turn fits the episode's token budget and the model's length."""
        budget = self.info.max_episode_tokens
        if budget and len(episode.tokens) + max_tokens > budget:
            episode.fail(f"token budget: {len(episode.tokens)} tokens + a {max_tokens}-token turn > {budget}")
            return False
        if max_model_len and len(episode.context()) + max_tokens >= max_model_len:
            episode.fail(
                f"token budget: {len(episode.context())} tokens + a {max_tokens}-token turn >= max_model_len "
                f"{max_model_len}"
            )
            return False
        return True


def _replies(
    going: list[Episode], live: list[Episode], replies: Sequence[env_pb2.EnvReply]
) -> list[tuple[Episode, env_pb2.EnvReply]]:
    by_episode = {id(e): r for e, r in zip(live, replies, strict=True)}
    return [(e, by_episode[id(e)]) for e in going]
