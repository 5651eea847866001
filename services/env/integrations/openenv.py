"""An OpenEnv environment server as a multi-turn grpo-mesh environment.

    --env services.env.integrations.openenv:OpenEnvEnvironment --env-arg url=http://127.0.0.1:8000
    [--env-arg action_field=message] [--env-arg observation_field=...] [--env-arg max_turns=4]

**Why the wire protocol, not `import openenv`.** openenv 0.10.0 depends on fastmcp 3, which pins
`mcp<2`; vLLM in grpo-mesh's `.venv` needs `mcp>=2`, and installing openenv there downgrades it. So the
OpenEnv server runs as its own process from its own virtualenv (`scripts/venv_openenv.sh` creates
`.venvs/openenv`), and this adapter speaks the protocol OpenEnv's own `EnvClient` speaks
(`openenv/core/env_client.py`), with `websockets` from our `.venv`: one WebSocket per session at
`{url}/ws`, JSON frames `{"type": "reset", "data": {"seed": S}}`, `{"type": "step", "data": ACTION}`,
`{"type": "close"}`, answered by `{"type": "observation", "data": {"observation", "reward", "done"}}`
or `{"type": "error", "data": {"message", "code"}}`. The WebSocket, not HTTP: OpenEnv's HTTP `/reset`
and `/step` build a fresh environment per request (`http_server.py`), so only a WebSocket session
keeps an episode's state between steps.

**Prompts.** `sample` resets one session per position, seeded from (the `seed` option, split,
position), and the reset observation's text is the prompt's user message (after `system_prompt`, if
set). The seed travels in the prompt's metadata, so the same prompt is always the same game.

**Stateless over stateful.** Our `respond(prompt, transcript)` must be answerable by any worker
process, again after a restart; OpenEnv's session is state on the server. Each process keeps a map
from (seed, the actions already stepped) to live sessions, bounded by `max_sessions` (least recently
used closed first). A turn takes the session whose actions are the transcript's earlier assistant
messages and steps the last one. On a miss (another process served the earlier turns, the session
died, this process restarted) it opens a session, resets it with the prompt's seed and replays the
earlier actions, checking that the replayed observations equal the transcript's messages: a server
that is not deterministic under its seed raises instead of silently training on a different game.
So correctness never depends on what a process remembers; the map only saves replays.

**Rewards.** Each step's `observation` becomes the next user message, its `reward` the turn's
`Reply.reward`, `done` ends the episode. The scheduler asks `respond` after model turns 1 ..
`max_turns` − 1 only, so an episode that used all `max_turns` turns has one action no `respond`
stepped: `score_episodes` steps it and that step's reward is the episode's score (an episode that
ended on `done` scores 0, all its reward having come per turn). Score plus per-turn rewards is
therefore exactly the OpenEnv episode return: the sum of the rewards of the steps taken. A step with
no reward (`null`) counts 0.

**Deadlines.** Every connect, send and receive has `timeout` seconds; a session that timed out is
closed, never reused (its late answer would pair with the next request). An unreachable or failing
server makes `respond` raise (the env service's failure policy applies) and fails that episode's
score; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.env.base import Environment, Message, PromptItem, Reply, Score, SplitName, failure

MAX_FRAME_BYTES = 16 * 1024 * 1024


class OpenEnvError(RuntimeError):
    """The OpenEnv server refused, failed, timed out or answered something this adapter cannot use."""


class OpenEnvOptions(BaseModel):
    """Where the OpenEnv server is and how text maps to its actions and observations."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(
        default="http://127.0.0.1:8000", description="The OpenEnv server (http(s):// or ws(s)://)."
    )
    action_field: str = Field(default="message", description="The action field the model's message goes in.")
    observation_field: str | None = Field(
        default=None,
        description="The observation field shown to the model; none = its only text field, else all as JSON.",
    )
    system_prompt: str | None = Field(
        default=None, description="A system message before the first observation."
    )
    max_turns: int = Field(default=4, ge=1, le=64, description="Model turns (steps) per episode.")
    seed: int = Field(default=0, description="Seeds every reset: (seed, split, position) → the reset's seed.")
    eval_size: int = Field(default=32, ge=0, description="Number of held-out eval games.")
    timeout: float = Field(default=10.0, gt=0, description="Seconds for one connect, reset or step.")
    max_sessions: int = Field(default=64, ge=1, description="Live sessions kept per process for later turns.")

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.netloc:
            raise ValueError(f"expected http(s):// or ws(s)://host:port, got {url!r}")
        return url.rstrip("/")


def ws_url(url: str) -> str:
    """The server's session endpoint: http://h:p/x → ws://h:p/x/ws (https → wss)."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/ws", "", ""))


def reset_seed(seed: int, split: str, position: int) -> int:
    """The reset seed of a split's position (deterministic, 31 bits)."""
    digest = hashlib.sha256(f"openenv/{seed}/{split}/{position}".encode()).digest()
    return int.from_bytes(digest[:4], "big") >> 1


def actions_key(seed: int, actions: Sequence[str]) -> str:
    """The key of a session that was reset with `seed` and stepped `actions`, in order."""
    return hashlib.sha256(json.dumps([seed, list(actions)]).encode()).hexdigest()


def observation_text(observation: Any, field: str | None) -> str:
    """What the model reads of an observation: `field`, else its only text field, else it all as JSON."""
    if not isinstance(observation, dict):
        return str(observation)
    if field is not None:
        if field not in observation:
            raise OpenEnvError(f"the observation has no field {field!r}; it has {sorted(observation)}")
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    shown = {k: v for k, v in observation.items() if k != "metadata"}
    texts = [v for v in shown.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(shown, sort_keys=True)


class Step:
    """One answer of the server: the observation (as the model reads it), its reward and done."""

    def __init__(self, data: dict[str, Any], field: str | None) -> None:
        self.text = observation_text(data.get("observation", {}), field)
        reward = data.get("reward")
        self.reward: float | None = None if reward is None else float(reward)
        self.done = bool(data.get("done", False))


class Session:
    """One OpenEnv WebSocket session: one request at a time, each under the deadline."""

    def __init__(self, ws: Any, seed: int, timeout: float) -> None:
        self.ws, self.seed, self.timeout = ws, seed, timeout
        self.actions: list[str] = []
        self.done = False

    @classmethod
    async def open(cls, url: str, seed: int, deadline_s: float) -> Session:
        from websockets.asyncio.client import connect

        try:
            ws = await connect(
                url, open_timeout=deadline_s, close_timeout=1.0, ping_interval=None,
                max_size=MAX_FRAME_BYTES, proxy=None,
            )  # fmt: skip
        except Exception as exc:
            raise OpenEnvError(
                f"cannot open an OpenEnv session at {url}: {type(exc).__name__}: {exc}"
            ) from exc
        return cls(ws, seed, deadline_s)

    async def request(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self.timeout):
                await self.ws.send(json.dumps(message))
                raw = await self.ws.recv()
        except TimeoutError:
            await self.close()
            raise OpenEnvError(f"OpenEnv {what} took longer than {self.timeout:g}s") from None
        except Exception as exc:
            await self.close()
            raise OpenEnvError(f"OpenEnv {what} failed: {type(exc).__name__}: {exc}") from exc
        try:
            answer = json.loads(raw)
        except (TypeError, ValueError) as exc:
            await self.close()
            raise OpenEnvError(f"OpenEnv {what}: not JSON: {exc}") from exc
        if answer.get("type") == "error":
            data = answer.get("data") or {}
            raise OpenEnvError(f"OpenEnv {what} refused: {data.get('message')} ({data.get('code')})")
        if answer.get("type") != "observation" or not isinstance(answer.get("data"), dict):
            await self.close()
            raise OpenEnvError(f"OpenEnv {what}: unexpected answer {str(answer)[:200]}")
        return answer["data"]

    async def reset(self, field: str | None) -> Step:
        return Step(await self.request({"type": "reset", "data": {"seed": self.seed}}, "reset"), field)

    async def step(self, action: dict[str, Any], text: str, field: str | None) -> Step:
        if self.done:
            raise OpenEnvError("step after the OpenEnv episode ended")
        result = Step(await self.request({"type": "step", "data": action}, "step"), field)
        self.actions.append(text)
        self.done = result.done
        return result

    @property
    def alive(self) -> bool:
        from websockets.protocol import State

        return self.ws.state is State.OPEN

    async def close(self) -> None:
        ws = self.ws
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                if ws.state.name == "OPEN":
                    await ws.send(json.dumps({"type": "close"}))
                await ws.close()


class Sessions:
    """This process's live sessions by (seed, actions stepped); least recently used closed first.
    Taking a session removes it, so two turns never share one."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._live: OrderedDict[str, list[Session]] = OrderedDict()
        self.hits = self.misses = 0

    def take(self, key: str) -> Session | None:
        while key in self._live:
            sessions = self._live[key]
            session = sessions.pop()
            if not sessions:
                del self._live[key]
            if session.alive:
                self.hits += 1
                return session
            # closed by the server meanwhile (restart, idle reaping): fall through to the next or a replay
        self.misses += 1
        return None

    async def put(self, session: Session) -> None:
        key = actions_key(session.seed, session.actions)
        self._live.setdefault(key, []).append(session)
        self._live.move_to_end(key)
        while sum(len(s) for s in self._live.values()) > self.limit:
            _, oldest = self._live.popitem(last=False)
            for stale in oldest:
                await stale.close()

    def __len__(self) -> int:
        return sum(len(s) for s in self._live.values())


class OpenEnvEnvironment(Environment[OpenEnvOptions]):
    """An OpenEnv server's episodes: reset observation = prompt, step observation = next user message."""

    name: ClassVar[str] = "openenv"
    description: ClassVar[str] = "An OpenEnv environment server, over its WebSocket session protocol."
    max_turns: ClassVar[int] = 4
    respond_timeout: ClassVar[float] = 60.0  # a replay is up to max_turns steps, each under `timeout`

    def __init__(self, options: OpenEnvOptions | None = None) -> None:
        super().__init__(options)
        self.sessions = Sessions(self.options.max_sessions)
        self._url = ws_url(self.options.url)

    # ----------------------------------------------------------------- prompt source
    def split_size(self, split: SplitName) -> int:
        return 0 if split == "train" else self.options.eval_size

    async def sample(self, n: int, split: SplitName, start: int) -> list[PromptItem]:
        """The prompts at positions start .. start+n-1: one seeded reset each (at most 8 at once)."""
        at_once = asyncio.Semaphore(8)

        async def one(position: int) -> PromptItem:
            async with at_once:
                seed = reset_seed(self.options.seed, split, position)
                session = await Session.open(self._url, seed, self.options.timeout)
                try:
                    first = await session.reset(self.options.observation_field)
                finally:
                    await session.close()
            messages: list[dict[str, str]] = []
            if self.options.system_prompt:
                messages.append({"role": "system", "content": self.options.system_prompt})
            messages.append({"role": "user", "content": first.text})
            return PromptItem(
                id=f"{self.name}-{split}-{position}",
                messages=tuple(messages),
                metadata={"seed": str(seed), "observation": first.text},
            )

        return list(await asyncio.gather(*(one(start + i) for i in range(n))))

    # ----------------------------------------------------------------- episodes (in a scoring worker)
    def _action(self, text: str) -> dict[str, Any]:
        return {self.options.action_field: text}

    async def _session_after(
        self, prompt: PromptItem, transcript: Sequence[Message], stepped: int
    ) -> Session:
        """A live session that was reset with the prompt's seed and stepped the transcript's first
        `stepped` assistant messages: from this process's map, else opened and replayed."""
        seed = int(prompt.metadata["seed"])
        actions = _actions(transcript)[:stepped]
        session = self.sessions.take(actions_key(seed, actions))
        if session is not None:
            return session
        field = self.options.observation_field
        session = await Session.open(self._url, seed, self.options.timeout)
        try:
            first = await session.reset(field)
            if first.text != prompt.metadata.get("observation", first.text):
                raise OpenEnvError(
                    f"reset with seed {seed} gave {first.text[:80]!r}, not the prompt's "
                    f"{prompt.metadata['observation'][:80]!r}: the server is not deterministic under its seed"
                )
            shown = _observations(transcript)
            for index, action in enumerate(actions):
                result = await session.step(self._action(action), action, field)
                if result.done:
                    raise OpenEnvError(f"replaying action {index + 1} ended the episode early")
                if index < len(shown) and shown[index] != result.text:
                    raise OpenEnvError(
                        f"replaying action {index + 1} gave {result.text[:80]!r}, but the episode saw "
                        f"{shown[index][:80]!r}: the server is not deterministic under its seed"
                    )
        except BaseException:
            await session.close()
            raise
        return session

    async def _step_last(self, prompt: PromptItem, transcript: Sequence[Message], keep: bool = True) -> Step:
        """Step the transcript's last assistant message; keep the session for the next turn if `keep`
        and the episode goes on, else close it."""
        actions = _actions(transcript)
        if not actions:
            raise OpenEnvError("the transcript has no assistant message to step")
        session = await self._session_after(prompt, transcript, len(actions) - 1)
        try:
            result = await session.step(
                self._action(actions[-1]), actions[-1], self.options.observation_field
            )
        except BaseException:
            await session.close()
            raise
        if keep and not result.done:
            await self.sessions.put(session)
        else:
            await session.close()
        return result

    async def respond(self, prompt: PromptItem, transcript: list[Message]) -> Reply:
        """Step the model's last message; the observation is the next user message."""
        result = await self._step_last(prompt, transcript)
        if result.done:
            return Reply(done=True, reward=result.reward)
        return Reply(messages=[{"role": "user", "content": result.text}], reward=result.reward)

    async def score_episodes(
        self, prompt: PromptItem, transcripts: Sequence[Sequence[Message]]
    ) -> list[Score | float | None]:
        """The reward of the step no `respond` took (the last of an episode that used every turn),
        else 0: with the per-turn rewards, the OpenEnv episode return."""

        async def one(transcript: Sequence[Message]) -> Score:
            if len(_actions(transcript)) < self.turn_limit:
                return Score(reward=0.0, details={"stepped_at_scoring": "0"})
            try:
                result = await self._step_last(prompt, transcript, keep=False)
            except OpenEnvError as exc:
                return failure("openenv", str(exc))
            reward = 0.0 if result.reward is None else result.reward
            return Score(reward=reward, parsed_answer=result.text, details={"stepped_at_scoring": "1"})

        return list(await asyncio.gather(*(one(t) for t in transcripts)))

    def score_one(self, prompt: PromptItem, completion: str) -> Score:
        raise NotImplementedError("an OpenEnv episode is scored by stepping it (score_episodes)")


def _actions(transcript: Sequence[Message]) -> list[str]:
    return [str(m.get("content") or "") for m in transcript if m.get("role") == "assistant"]


def _observations(transcript: Sequence[Message]) -> list[str]:
    """The environment's messages after each assistant message (what earlier steps showed)."""
    return [str(m.get("content") or "") for m in transcript if m.get("role") == "user"]
