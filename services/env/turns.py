"""What a multi-turn environment's turn is made of: messages (plain dicts) and the `Reply`.

Kept apart from `base.py` so the tool machinery (`episodes.py`) can use them without importing the
environment base class.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# A chat message as environments see it: {"role": "assistant"|"tool"|"user"|"system", "content": str},
# assistant messages may carry "tool_calls" ([{"id", "name", "arguments"}]), tool messages
# "tool_call_id" and "name".
Message = dict[str, Any]


@dataclass
class Reply:
    """The environment's turn after a model turn: messages to append (tool results, a user message) and
    whether the episode is over. `reward` is an optional per-turn reward, added to the episode's score.
    `tool_calls` / `tool_errors` count the model turn's calls and the failed ones (metrics)."""

    messages: list[Message] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0


def final_text(transcript: Sequence[Message]) -> str:
    """The content of the transcript's last assistant message ("" if none): what `score` reads."""
    for message in reversed(transcript):
        if message.get("role") == "assistant":
            return str(message.get("content") or "")
    return ""


__all__ = ["Message", "Reply", "final_text"]
