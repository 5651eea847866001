"""Sticky sessions and the token-prefix rule of an episode (pure logic: no I/O).

A session (`X-Session-ID`) is one episode. Its calls go to one rollout, chosen least loaded when the
session is first seen and kept while that rollout is usable (a rollout that is not gets the session
moved, and the move is kept). The table is a bounded LRU with a time to live: the least recently
used session goes when it is full, a session unused for `ttl_s` is forgotten.

The prefix rule. A trainer learns from the exact tokens of an episode, so each call's prompt must
be the previous call's prompt followed by one of its choices' tokens, then anything new (the
environment's turn): an exact prefix-extension. A call that is not one is a prefix violation: it
is counted (`episode/prefix_violations`) and the policy is **drop**: the session's episode is
marked broken with the reason (the first violation's), every later record of the session carries it,
and a trainer must not train on the episode. The call itself is still answered (the agent's run goes
on; only its training use ends). The first call of a session has nothing to extend.

Chat turns are bridged, not re-rendered. When a chat call of a session repeats the previous chat
call's messages, then one of the assistant messages the gateway answered it with (same content, same
tool calls), then new messages (tool results, the user's answer), and names the same tools, its
prompt is that call's prompt + that choice's sampled tokens + the rollout's BRIDGE rendering of the
new messages only (`bridge_plan`). The episode's earlier tokens are then never rendered again, so a
chat agent's multi-turn episode stays token-exact even where re-rendering the conversation would not
give back the tokens the model sampled. Anything else is rendered whole (and checked by the rule).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# A chat message in comparable form: (role, text, ((tool name, canonical arguments JSON), ...),
# tool_call_id, name). Ids of the model's own tool calls are left out: a client may rename them.
Canonical = tuple[str, str, tuple[tuple[str, str], ...], str, str]


def canonical_arguments(arguments_json: str) -> str:
    try:
        return json.dumps(json.loads(arguments_json), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return arguments_json


@dataclass(frozen=True)
class ChatTurn:
    """What the last chat call of a session was: its messages and tools, and the assistant message
    each choice answered with, in canonical form."""

    messages: tuple[Canonical, ...]
    tools_json: str
    replies: tuple[Canonical, ...]


@dataclass
class Session:
    session_id: str
    rollout: str
    last_seen: float
    # what the next prompt must extend: the last call's prompt + each choice's tokens
    extends: tuple[tuple[int, ...], ...] = ()
    calls: int = 0
    broken: str = ""
    in_flight: int = field(default=0)
    # the last call's completions (by choice) and, when it was a chat call, its messages
    completions: tuple[tuple[int, ...], ...] = ()
    chat: ChatTurn | None = None


def bridge_plan(
    session: Session, messages: tuple[Canonical, ...], tools_json: str
) -> tuple[tuple[int, ...], tuple[int, ...], int] | None:
    """(the tokens to extend: the previous prompt + the chosen choice's tokens, that choice's tokens,
    the index of the first new message) when `messages` continue the session's last chat call after
    one of its replies; None when the conversation must be rendered whole."""
    turn = session.chat
    if turn is None or tools_json != turn.tools_json:
        return None
    before = len(turn.messages)
    if len(messages) <= before + 1 or messages[:before] != turn.messages:
        return None
    reply = messages[before]
    for index, answered in enumerate(turn.replies):
        if answered == reply and index < len(session.extends):
            return session.extends[index], session.completions[index], before + 1
    return None


def is_prefix_extension(prompt: Sequence[int], candidates: Sequence[Sequence[int]]) -> bool:
    """Whether `prompt` starts with one of the `candidates` (an empty list of candidates: yes)."""
    if not candidates:
        return True
    return any(len(prompt) >= len(c) and tuple(prompt[: len(c)]) == tuple(c) for c in candidates)


def first_difference(prompt: Sequence[int], candidate: Sequence[int]) -> int:
    """The first position where `prompt` departs from `candidate` (len(prompt) when it is shorter)."""
    for position, (a, b) in enumerate(zip(prompt, candidate, strict=False)):
        if a != b:
            return position
    return min(len(prompt), len(candidate))


class SessionTable:
    """Bounded LRU of sessions with a TTL, and the prefix-violation count."""

    def __init__(self, max_sessions: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._max = max_sessions
        self._ttl = ttl_s
        self._clock = clock
        self.prefix_violations = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, session_id: str) -> Session | None:
        """The live session (refreshed as recently used), or None when unknown or expired."""
        session = self._sessions.get(session_id)
        if session is None:
            return None
        now = self._clock()
        if now - session.last_seen > self._ttl and session.in_flight == 0:
            del self._sessions[session_id]
            return None
        session.last_seen = now
        self._sessions.move_to_end(session_id)
        return session

    def open(self, session_id: str, rollout: str) -> Session:
        """A new session bound to `rollout` (the least recently used goes when the table is full)."""
        now = self._clock()
        self._expire(now)
        while len(self._sessions) >= self._max:
            self._sessions.popitem(last=False)
            self.evicted += 1
        session = self._sessions[session_id] = Session(session_id, rollout, now)
        return session

    def _expire(self, now: float) -> None:
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if now - oldest.last_seen <= self._ttl or oldest.in_flight:
                return
            del self._sessions[oldest.session_id]

    def check_prefix(self, session: Session, prompt: Sequence[int]) -> str:
        """ "" when `prompt` extends the session's last call; else the violation's reason, counted, and
        the session's episode marked broken (the first reason is kept)."""
        if is_prefix_extension(prompt, session.extends):
            return ""
        self.prefix_violations += 1
        where = max(first_difference(prompt, c) for c in session.extends)
        reason = (
            f"prefix violation at call {session.calls + 1}: the prompt ({len(prompt)} tokens) departs from "
            f"the previous call's prompt + completion at token {where}"
        )
        if not session.broken:
            session.broken = reason
        return reason

    @staticmethod
    def advance(
        session: Session, prompt: Sequence[int], completions: Sequence[Sequence[int]], chat: ChatTurn | None
    ) -> None:
        """After a call: the next prompt must extend this prompt + one of these completions; `chat`:
        what a chat call's messages and replies were (None after any other call)."""
        base = tuple(prompt)
        session.completions = tuple(tuple(c) for c in completions)
        session.extends = tuple(base + c for c in session.completions)
        session.chat = chat
        session.calls += 1
