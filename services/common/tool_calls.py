"""The model's tool calls, parsed from (and rendered to) the chat template's own text format.

Supported format: **hermes** only (`SUPPORTED_FORMATS`), the tool-call format of the ChatML family:
Qwen2, Qwen2.5, SmolLM2 and our tiny model. A call is a JSON object between tags, anywhere in the
assistant's text, zero or more per turn:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12345 * 678"}}
    </tool_call>

`arguments` may also be a JSON string holding an object (some models emit OpenAI's wire shape); a missing
`arguments` means no arguments. Whitespace and newlines around the JSON are ignored.

Qwen2/Qwen2.5 templates write the tool definitions (in the system message) and an assistant message's
`tool_calls` in this format themselves; `render_tool_calls` produces exactly their text. The SmolLM2
and tiny-model templates are plain ChatML with no tool section: whoever renders their prompts puts the
tool definitions in the system message and an assistant's calls into its content as
`render_tool_calls` text, so the model sees (and is trained to write) the same format.

Other formats are not supported yet because no built-in model uses them and each needs its own parser
and renderer that must round-trip through its template byte for byte: Llama 3's `<|python_tag|>` /
bare-JSON calls, Mistral's `[TOOL_CALLS][...]`, DeepSeek's `<｜tool▁call▁begin｜>` blocks, Qwen3-Coder's
XML `<function=...>` parameters and harmony (gpt-oss) channels. A model with one of those templates
parses no calls here: its tool-call text stays in `ParsedTurn.content`.

Parsing never raises. Each malformed block (invalid JSON, no `name`, `arguments` not an object, no
closing `</tool_call>`, a block over `MAX_BLOCK_CHARS`, more than `MAX_CALLS` blocks) becomes a
`CallError` whose message is written for the model: it is shown to it as the tool's answer, so it says
what was wrong and what the format is. Pure functions, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_FORMATS = ("hermes",)
OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
MAX_CALLS = 16  # blocks parsed per turn; the rest are reported by one CallError
MAX_BLOCK_CHARS = 64 * 1024  # characters between the tags
MAX_NAME_CHARS = 128
MAX_RAW_CHARS = 512  # of a malformed block kept in CallError.raw
FORMAT_HINT = '<tool_call>{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}</tool_call>'
_WHITESPACE = " \t\r\n"


@dataclass(frozen=True)
class ParsedCall:
    """One well-formed call. `arguments_json` is the canonical JSON text of `arguments`."""

    id: str
    name: str
    arguments: dict[str, Any]
    arguments_json: str


@dataclass(frozen=True)
class CallError:
    """A malformed call: `index` is its block's position in the turn (0-based), `raw` its text (bounded)."""

    index: int
    message: str
    raw: str


@dataclass(frozen=True)
class ParsedTurn:
    """The text outside the tool-call blocks (stripped), the calls, and the malformed blocks."""

    content: str
    calls: tuple[ParsedCall, ...]
    errors: tuple[CallError, ...]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _skip_whitespace(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def _bounded(raw: str) -> str:
    if len(raw) <= MAX_RAW_CHARS:
        return raw
    return raw[:MAX_RAW_CHARS] + f"... ({len(raw) - MAX_RAW_CHARS} more characters)"


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "number",
        float: "number",
    }.get(type(value), type(value).__name__)


def _call_from_object(obj: Any, call_id: str) -> ParsedCall | str:
    """A ParsedCall from a decoded block, or the reason it is not one."""
    if not isinstance(obj, dict):
        return f'expected a JSON object with "name" and "arguments", got a JSON {_type_name(obj)}'
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        got = 'no "name"' if "name" not in obj else f'"name" is a JSON {_type_name(name)}'
        if isinstance(name, str):
            got = '"name" is empty'
        return f'{got}; "name" must be the tool\'s name as a non-empty string'
    if len(name) > MAX_NAME_CHARS:
        return f'"name" is {len(name)} characters long, at most {MAX_NAME_CHARS}'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = _DECODER.decode(arguments)
        except (ValueError, RecursionError) as e:
            return f'"arguments" is a string that is not valid JSON ({e})'
    if not isinstance(arguments, dict):
        return f'"arguments" must be a JSON object, got a JSON {_type_name(arguments)}'
    return ParsedCall(call_id, name, arguments, json.dumps(arguments, ensure_ascii=False))


def _decode_block(text: str, body_start: int) -> tuple[Any, int] | str:
    """Decode the JSON object that starts a block: (object, end of the block) or the decoding error."""
    start = _skip_whitespace(text, body_start)
    window = text[start : body_start + MAX_BLOCK_CHARS]
    try:
        obj, end = _DECODER.raw_decode(window)
    except json.JSONDecodeError as e:
        return f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}"
    except RecursionError:
        return "invalid JSON: nested too deeply"
    except ValueError as e:
        return f"invalid JSON: {e}"
    after = _skip_whitespace(text, start + end)
    if text.startswith(CLOSE_TAG, after):
        return obj, after + len(CLOSE_TAG)
    return f"unexpected text after the JSON object: {text[after : after + 40]!r}"


def parse_tool_calls(text: str, id_prefix: str = "call") -> ParsedTurn:
    """Parse the hermes tool calls of one assistant turn; never raises.

    Ids are `f"{id_prefix}_{i}"` where i is the block's position in the turn (malformed blocks count, so
    an id and a CallError index never collide).
    """
    content: list[str] = []
    calls: list[ParsedCall] = []
    errors: list[CallError] = []
    pos = index = extra = 0
    first_extra = -1
    while True:
        start = text.find(OPEN_TAG, pos)
        if start < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        body_start = start + len(OPEN_TAG)
        if index >= MAX_CALLS:  # counted, not parsed
            close = text.find(CLOSE_TAG, body_start)
            extra += 1
            first_extra = index if first_extra < 0 else first_extra
            index += 1
            pos = len(text) if close < 0 else close + len(CLOSE_TAG)
            continue
        decoded = _decode_block(text, body_start)
        if isinstance(decoded, tuple):
            obj, pos = decoded
            made = _call_from_object(obj, f"{id_prefix}_{index}")
            if isinstance(made, ParsedCall):
                calls.append(made)
            else:
                errors.append(_error(index, made, text[start:pos]))
            index += 1
            continue
        close = text.find(CLOSE_TAG, body_start)
        if close < 0:
            errors.append(_error(index, f"{OPEN_TAG} is never closed by {CLOSE_TAG}", text[start:]))
            break
        pos = close + len(CLOSE_TAG)
        reason = decoded
        if close - body_start > MAX_BLOCK_CHARS:
            reason = f"the block is {close - body_start} characters long, at most {MAX_BLOCK_CHARS}"
        errors.append(_error(index, reason, text[start:pos]))
        index += 1
    if extra:
        errors.append(
            CallError(
                first_extra,
                f"too many tool calls: {index} in one turn, at most {MAX_CALLS}; "
                f"the last {extra} were not run. Make fewer calls per turn.",
                "",
            )
        )
    return ParsedTurn("".join(content).strip(), tuple(calls), tuple(errors))


def _error(index: int, reason: str, raw: str) -> CallError:
    return CallError(
        index, f"malformed tool call {index}: {reason}. Write a call as {FORMAT_HINT}", _bounded(raw)
    )


def _name_and_arguments(call: Any) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of a ParsedCall, an object with name/arguments_json (the ToolCall proto) or an
    OpenAI-style dict ({"function": {"name": ..., "arguments": "<json>"}} or {"name", "arguments"})."""
    if isinstance(call, Mapping):
        fields = call.get("function", call)
        if not isinstance(fields, Mapping):
            raise ValueError("tool_calls[].function must be an object")
        name, arguments = fields.get("name"), fields.get("arguments", {})
    else:
        name = getattr(call, "name", None)
        arguments = getattr(call, "arguments", None)
        if arguments is None:
            arguments = getattr(call, "arguments_json", "") or "{}"
    if not isinstance(name, str) or not name:
        raise ValueError("tool_calls[].function.name must be a non-empty string")
    if isinstance(arguments, str):
        try:
            arguments = _DECODER.decode(arguments)
        except (ValueError, RecursionError) as e:
            raise ValueError(f"tool_calls[].function.arguments is not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise ValueError("tool_calls[].function.arguments must be a JSON object")
    return name, arguments


def render_tool_calls(calls: Iterable[Any]) -> str:
    """The canonical hermes text of calls, as Qwen2.5's chat template writes them after an assistant's
    content: one `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` per call, joined by
    newlines. Accepts ParsedCall, the ToolCall proto or OpenAI-style dicts; raises ValueError naming
    the field for a call that has no name or whose arguments are not a JSON object.
    """
    blocks = []
    for call in calls:
        name, arguments = _name_and_arguments(call)
        payload = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
        payload += json.dumps(arguments, ensure_ascii=False) + "}"
        blocks.append(f"{OPEN_TAG}\n{payload}\n{CLOSE_TAG}")
    return "\n".join(blocks)
