"""Chat messages to tokens through the model's chat template, for first prompts and for the bridges
that append an environment's turn to an episode (pure: a tokenizer in, token ids out; no I/O).

Three renderings (`RenderMessages`' modes):

- `conversation`: the whole conversation (and the tools), then the generation prompt if asked:
  `apply_chat_template(..., tokenize=False)`, the text tokenized with add_special_tokens=False.
- `bridge`: the tokens that follow a model turn: the end of the assistant's turn the model did not
  sample itself, the new messages, the generation prompt. Nothing before is rendered again, so the
  episode's earlier tokens (the model's own samples above all) never change. It renders a fixed
  conversation [user "x", assistant "y"] (tokens A) and the same with the new messages and the
  generation prompt (tokens B); B must start with A (the template is prefix-preserving for these
  messages) or the request fails. The assistant's close C is the part of A after the content "y"
  (ChatML: `<|im_end|>` `\\n`): when the model's turn ends with a prefix of C (it sampled
  `<|im_end|>` as its end-of-turn token) only the rest of C is added, else all of C (a turn cut by
  the token limit, or ended by an EOS token that is not part of the template). This matches
  templates whose close starts with a special token (ChatML, Llama 3, Gemma, Phi-3); a close that
  starts with ordinary text may be mistaken for the end of a truncated turn that ends with that text.
- `text`: a text tokenized as it is.

Supported templates, and how tools are rendered:

- Templates that render tools themselves (Qwen2.5, Qwen3: hermes style): messages go in Hugging
  Face's format (assistant `tool_calls` as `{"type": "function", "id", "function": {"name",
  "arguments": <dict>}}`, tool messages with `tool_call_id` and `name`), tools as `tools=`.
- Templates that ignore `tools` (detected once per tokenizer: a conversation renders the same with
  and without a probe tool), e.g. SmolLM2-135M-Instruct's ChatML template and the tiny model's:
  the rollout renders what Qwen2.5's template would. The tools go into the system message as
  Qwen2.5's "# Tools" block (a system message holding only that block is prepended when there is
  none), an assistant's tool calls not already in its content are appended to it as
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, and tool messages become one user
  message of `<tool_response>` blocks per run of consecutive tool messages. On a ChatML template
  with a system message, the result is token for token what Qwen2.5's template renders.
- Templates that raise on, or drop, the "tool" role get the same `<tool_response>` user messages.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.tool_calls import render_tool_calls

CHAT_ROLES = ("system", "user", "assistant", "tool")

# Qwen2.5's tool block (its chat template's wording), after the system message's own text.
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool_7q", "description": "probe", "parameters": {"type": "object"}},
}
_PROBE_RESULT = "probe-result-7q"
# The fixed conversation a bridge is rendered after (its content never reaches the result).
_DUMMY = ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"})


@dataclass(frozen=True)
class ToolCallInput:
    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class MessageInput:
    """A chat message as the rollout renders it (`ChatMessage`)."""

    role: str
    content: str
    tool_calls: tuple[ToolCallInput, ...] = ()
    tool_call_id: str = ""
    name: str = ""


@dataclass(frozen=True)
class Rendered:
    token_ids: list[int]
    text: str


def parse_tools(tools_json: str, field: str = "tools_json") -> list[dict[str, Any]] | None:
    """The tools of a `tools_json` (a JSON array of objects), None when it is empty."""
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except ValueError as exc:
        raise InvalidArgument(f"{field} is not valid JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidArgument(f"{field} must be a JSON array of tool objects")
    return tools or None


def hf_messages(messages: Sequence[MessageInput], field: str = "messages") -> list[dict[str, Any]]:
    """Hugging Face's message dicts (tool call arguments parsed into dicts)."""
    result = []
    for position, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise InvalidArgument(
                f"{field}[{position}].role must be one of {CHAT_ROLES}, got {message.role!r:.80}"
            )
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.tool_calls:
            calls = []
            for index, call in enumerate(message.tool_calls):
                where = f"{field}[{position}].tool_calls[{index}]"
                if not call.name:
                    raise InvalidArgument(f"{where}.name is empty")
                try:
                    arguments = json.loads(call.arguments_json or "{}")
                except ValueError as exc:
                    raise InvalidArgument(f"{where}.arguments_json is not valid JSON: {exc}") from None
                if not isinstance(arguments, dict):
                    raise InvalidArgument(f"{where}.arguments_json must be a JSON object")
                function = {"name": call.name, "arguments": arguments}
                calls.append({"type": "function", "id": call.id, "function": function})
            entry["tool_calls"] = calls
        if message.role == "tool":
            if message.tool_call_id:
                entry["tool_call_id"] = message.tool_call_id
            if message.name:
                entry["name"] = message.name
        result.append(entry)
    return result


def tools_block(tools: Sequence[dict[str, Any]]) -> str:
    """Qwen2.5's "# Tools" block listing `tools` (one JSON object per line, as its `tojson`)."""
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_HEADER + listed + TOOLS_FOOTER


def _hermes_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, native_tools: bool, native_role: bool
) -> list[dict[str, Any]]:
    """`messages` rewritten for a template without tool support, as Qwen2.5's template renders them."""
    result: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool" and not native_role:
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if result and result[-1].get("_tool_responses"):
                result[-1]["content"] += "\n" + block
            else:
                result.append({"role": "user", "content": block, "_tool_responses": True})
            continue
        if message.get("tool_calls") and not native_tools:
            content = message["content"]
            if "<tool_call>" not in content:  # a model's own turn keeps its calls in its text
                parts = ([content] if content else []) + [render_tool_calls(message["tool_calls"])]
                content = "\n".join(parts)
            message = {"role": message["role"], "content": content}
        result.append(message)
    for message in result:
        message.pop("_tool_responses", None)
    if tools and not native_tools:
        block = tools_block(tools)
        if result and result[0]["role"] == "system":
            result[0] = {**result[0], "content": result[0]["content"] + "\n\n" + block}
        else:
            result.insert(0, {"role": "system", "content": block})
    return result


class TemplateRenderer:
    """Renders through one tokenizer's chat template; what it learns about the template (tool
    support, the bridge's constants) is computed once and cached. Thread-safe."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._support: tuple[bool, bool] | None = None
        self._bridge_base = lru_cache(maxsize=16)(self._compute_bridge_base)

    # ------------------------------------------------------------------ template facts
    def _apply(self, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool) -> str:
        tokenizer = self._tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise FailedPrecondition("the tokenizer has no chat template: only text prompts can be rendered")
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kwargs["tools"] = tools
        try:
            return tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # jinja's TemplateError, raise_exception(), a missing key
            raise InvalidArgument(f"messages: the chat template rejected them: {exc}") from None

    def support(self) -> tuple[bool, bool]:
        """(renders tools itself, renders the "tool" role itself) for this template."""
        with self._lock:
            if self._support is None:
                plain = [{"role": "user", "content": "x"}]
                try:
                    with_tools = self._apply(plain, [_PROBE_TOOL], True)
                    native_tools = with_tools != self._apply(plain, None, True)
                except InvalidArgument:
                    native_tools = False
                try:
                    probe = [*_DUMMY, {"role": "tool", "content": _PROBE_RESULT, "tool_call_id": "c"}]
                    native_role = _PROBE_RESULT in self._apply(probe, None, True)
                except InvalidArgument:
                    native_role = False
                # a template that renders "tool" as just another role name (generic ChatML) but knows
                # no tools gets Qwen2.5's <tool_response> form, matching the hermes tools block
                self._support = (native_tools, native_role and native_tools)
            return self._support

    def _prepared(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[dict[str, Any]]:
        native_tools, native_role = self.support()
        if native_tools and native_role:
            return messages
        return _hermes_messages(messages, tools, native_tools, native_role)

    def _render_text(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        native_tools, _ = self.support()
        prepared = self._prepared(messages, tools)
        return self._apply(prepared, tools if native_tools else None, add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def _compute_bridge_base(self, tools_json: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(A, C): the dummy conversation's tokens and the assistant's close (A after "y")."""
        tools = parse_tools(tools_json)
        text = self._render_text(list(_DUMMY), tools, False)
        other = self._render_text([_DUMMY[0], {"role": "assistant", "content": "z"}], tools, False)
        suffix = 0  # the texts differ only in the content: what follows it is their common suffix
        while suffix < min(len(text), len(other)) and text[-1 - suffix] == other[-1 - suffix]:
            suffix += 1
        end = len(text) - suffix
        if text[end - 1 : end] != _DUMMY[1]["content"]:
            raise FailedPrecondition("the chat template does not render an assistant's content as it is")
        tokens, head = self._encode(text), self._encode(text[:end])
        if tokens[: len(head)] != head:
            raise FailedPrecondition(
                "the chat template's end of an assistant turn merges with its content into one token: "
                "bridges are not supported for it"
            )
        return tuple(tokens), tuple(tokens[len(head) :])

    # ------------------------------------------------------------------ renderings
    def conversation(
        self, messages: Sequence[MessageInput], tools_json: str = "", add_generation_prompt: bool = True
    ) -> list[int]:
        """Tokens of the whole conversation (with its tools), then the generation prompt if asked."""
        tools = parse_tools(tools_json)
        return self._encode(self._render_text(hf_messages(messages), tools, add_generation_prompt))

    def bridge(
        self,
        messages: Sequence[MessageInput],
        previous_tail: Sequence[int],
        tools_json: str = "",
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Tokens that append `messages` after a model turn ending in `previous_tail` (see the module)."""
        tools = parse_tools(tools_json)
        new = hf_messages(messages)
        base, close = self._bridge_base(tools_json)
        full = self._encode(self._render_text([*_DUMMY, *new], tools, add_generation_prompt))
        if tuple(full[: len(base)]) != base:
            raise FailedPrecondition(
                "the chat template is not prefix-preserving for these messages: appending them changes "
                "the tokens of the conversation before them"
            )
        return list(close[sampled_close(previous_tail, close) :]) + full[len(base) :]

    def text(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=False)


def sampled_close(previous_tail: Sequence[int], close: Sequence[int]) -> int:
    """How many tokens of the assistant's close `close` the model's turn already ends with (the
    longest prefix of `close` that `previous_tail` ends with; 0 when none)."""
    tail = list(previous_tail)
    for k in range(min(len(close), len(tail)), 0, -1):
        if tail[-k:] == list(close[:k]):
            return k
    return 0
