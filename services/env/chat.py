"""Prompt formatting: plain text vs chat messages, and how a prompt becomes model input text.

Environments serve either `text` (fed to the model as is) or `messages` (chat). The service can
convert between them (`prompt_format`): "chat" wraps a text prompt as one user message, "text"
flattens messages to "role: content" lines for models without a chat template.

`render_prompt` is the one rule for turning a prompt into the model's input string, shared with the
rollout side: text as is; messages through the tokenizer's chat template with the generation prompt
added when the tokenizer has one, else the flattened form. Works on `PromptItem` and on the
`grpo.common.v1.Prompt` proto alike.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from services.env.base import PromptItem

PromptFormat = Literal["auto", "text", "chat"]


def _messages(prompt: Any) -> list[dict[str, str]]:
    """Messages of a PromptItem (dicts) or a Prompt proto (ChatMessage objects) as plain dicts."""
    out = []
    for message in prompt.messages:
        if isinstance(message, dict):
            out.append({"role": str(message["role"]), "content": str(message["content"])})
        else:
            out.append({"role": message.role, "content": message.content})
    return out


def flatten_messages(messages: list[dict[str, str]]) -> str:
    """Chat as plain text: "role: content" per turn, then "assistant: " to cue the answer."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant: "])


def apply_format(item: PromptItem, mode: PromptFormat) -> PromptItem:
    """Convert a prompt to the served format ("auto" leaves it as the environment made it)."""
    if mode == "chat" and not item.is_chat:
        return replace(item, text="", messages=({"role": "user", "content": item.text},))
    if mode == "text" and item.is_chat:
        return replace(item, text=flatten_messages(_messages(item)), messages=())
    return item


def render_prompt(prompt: Any, tokenizer: Any | None = None) -> str:
    """The model input text of a prompt: the chat template when the tokenizer has one (see module doc)."""
    if not prompt.messages:
        return str(prompt.text)
    messages = _messages(prompt)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return flatten_messages(messages)
