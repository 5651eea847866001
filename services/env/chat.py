"""Prompt formats the service serves: plain text vs chat messages (`prompt_format`).

Environments make either `text` or `messages` prompts. The service can convert them before serving:
"chat" wraps a text prompt as one user message, "text" flattens messages to "role: content" lines
ending in "assistant: ", "auto" serves what the environment made.

Turning a prompt into model input is the rollout's job, not this module's: it feeds text as is and
renders messages with the tokenizer's chat template (generation prompt added), and rejects a chat
prompt when the tokenizer has no template (INVALID_ARGUMENT). For such models serve
`prompt_format="text"`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from services.env.base import PromptItem

PromptFormat = Literal["auto", "text", "chat"]


def flatten_messages(messages: list[dict[str, str]]) -> str:
    """Chat as plain text: "role: content" per turn, then "assistant: " to cue the answer."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant: "])


def apply_format(item: PromptItem, mode: PromptFormat) -> PromptItem:
    """Convert a prompt to the served format ("auto" leaves it as the environment made it)."""
    if mode == "chat" and not item.is_chat:
        return replace(item, text="", messages=({"role": "user", "content": item.text},))
    if mode == "text" and item.is_chat:
        return replace(item, text=flatten_messages(list(item.messages)), messages=())
    return item
