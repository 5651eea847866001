"""Served prompt formats: text ↔ chat conversion (`prompt_format`)."""

from __future__ import annotations

from services.env.base import PromptItem
from services.env.chat import apply_format, flatten_messages

TEXT = PromptItem(id="t", text="2+2=", reference_answer="4", metadata={"k": "v"})
CHAT = PromptItem(
    id="c", messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"})
)


def test_apply_format() -> None:
    assert apply_format(TEXT, "auto") is TEXT
    wrapped = apply_format(TEXT, "chat")
    assert wrapped.text == "" and wrapped.messages == ({"role": "user", "content": "2+2="},)
    assert (wrapped.id, wrapped.reference_answer, wrapped.metadata) == ("t", "4", {"k": "v"})
    flat = apply_format(CHAT, "text")
    assert flat.messages == () and flat.text == "system: Be brief.\nuser: 2+2?\nassistant: "
    assert apply_format(CHAT, "chat") is CHAT
    assert apply_format(TEXT, "text") is TEXT


def test_flatten_messages() -> None:
    assert flatten_messages([{"role": "user", "content": "hi"}]) == "user: hi\nassistant: "
