"""The tool part of a multi-turn environment's turn: the model's tool calls in, tool messages out.

`run_tools` is what `Environment.respond` does by default. It reads the calls of the transcript's last
assistant message (its `tool_calls` when the caller parsed them, else parsed here from its text in the
chat template's format, `services/common/tool_calls.py`), runs each through the environment's
`Toolbox` (validated arguments, a deadline per call, sync tools in a thread) and answers with one tool
message per call, in the order the model made them. A malformed call, an unknown tool, arguments that
do not validate, a tool that raises or runs past `tool_timeout` all become an error message the model
reads on its next turn: never an exception. A turn without any call ends the episode.

The toolbox of an environment is built once per process (scoring workers keep their environment).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from services.common.tool_calls import CallError, ParsedCall, parse_tool_calls
from services.env.tools.toolbox import Toolbox, error_message, tool_message
from services.env.turns import Message, Reply

_TOOLBOXES: dict[int, Toolbox] = {}


def toolbox_of(env: Any) -> Toolbox:
    """The environment's toolbox, built on first use (its tools' schemas are checked then)."""
    box = _TOOLBOXES.get(id(env))
    if box is None:
        box = _TOOLBOXES[id(env)] = Toolbox(list(env.tools()))
    return box


def tools_json(env: Any) -> str:
    """The environment's tools as Prompt.tools_json ("" when it has none)."""
    return toolbox_of(env).tools_json() if env.tools() else ""


def calls_of(message: Message, id_prefix: str) -> tuple[list[ParsedCall], list[CallError]]:
    """The tool calls of an assistant message: its own `tool_calls`, or parsed from its text."""
    given = message.get("tool_calls")
    if given:
        calls: list[ParsedCall] = []
        errors: list[CallError] = []
        for index, call in enumerate(given):
            raw = call.get("arguments", "{}")
            try:
                arguments = json.loads(raw) if isinstance(raw, str) else dict(raw)
                if not isinstance(arguments, dict):
                    raise ValueError("arguments are not a JSON object")
            except (ValueError, TypeError) as exc:
                errors.append(
                    CallError(index, f"arguments of call {index} are not a JSON object: {exc}", str(raw))
                )
                continue
            call_id = str(call.get("id") or f"{id_prefix}_{index}")
            calls.append(ParsedCall(call_id, str(call.get("name", "")), arguments, json.dumps(arguments)))
        return calls, errors
    parsed = parse_tool_calls(str(message.get("content") or ""), id_prefix=id_prefix)
    return list(parsed.calls), list(parsed.errors)


async def run_tools(env: Any, transcript: Sequence[Message]) -> Reply:
    """Run the tool calls of the transcript's last message; none ends the episode."""
    if not transcript or transcript[-1].get("role") != "assistant":
        return Reply(done=True)
    turn = sum(1 for m in transcript if m.get("role") == "assistant")
    calls, errors = calls_of(transcript[-1], id_prefix=f"call_{turn}")
    if not calls and not errors:
        return Reply(done=True)
    box = toolbox_of(env)
    results = await asyncio.gather(*(box.call(call, env.tool_timeout) for call in calls))
    messages = [tool_message(result) for result in results]
    messages.extend(error_message(error) for error in errors)
    failed = sum(1 for result in results if not result.ok) + len(errors)
    return Reply(messages=messages, tool_calls=len(calls) + len(errors), tool_errors=failed)
