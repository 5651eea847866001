"""Prompt formats: text ↔ chat conversion and rendering through a real tokenizer's chat template."""

from __future__ import annotations

import pytest

from grpo.common.v1 import types_pb2
from services.env.base import PromptItem
from services.env.chat import apply_format, flatten_messages, render_prompt

TEXT = PromptItem(id="t", text="2+2=")
CHAT = PromptItem(
    id="c", messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"})
)


def test_apply_format() -> None:
    assert apply_format(TEXT, "auto") is TEXT
    wrapped = apply_format(TEXT, "chat")
    assert wrapped.text == "" and wrapped.messages == ({"role": "user", "content": "2+2="},)
    flat = apply_format(CHAT, "text")
    assert flat.messages == () and flat.text == "system: Be brief.\nuser: 2+2?\nassistant: "
    assert apply_format(CHAT, "chat") is CHAT


def test_render_without_template() -> None:
    assert render_prompt(TEXT) == "2+2="
    assert render_prompt(CHAT) == flatten_messages(list(CHAT.messages))


@pytest.fixture(scope="module")
def tokenizer():
    from services.common.tiny_model import build_tokenizer

    return build_tokenizer(seed=0)


def test_render_with_chat_template_matches_tokenizer(tokenizer) -> None:
    expected = tokenizer.apply_chat_template(list(CHAT.messages), tokenize=False, add_generation_prompt=True)
    assert render_prompt(CHAT, tokenizer) == expected
    proto = types_pb2.Prompt(id="c")
    for m in CHAT.messages:
        proto.messages.add(role=m["role"], content=m["content"])
    assert render_prompt(proto, tokenizer) == expected
    assert render_prompt(TEXT, tokenizer) == "2+2="  # plain text is never templated
