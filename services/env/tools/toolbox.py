"""Tools as plain Python callables: their JSON schema from type hints, and running a parsed call safely.

A tool is a function (sync or async) with type-hinted parameters and a docstring. Its name is the
function's `__name__`, its description the docstring's text before a Google-style `Args:` section,
and each parameter's description the matching `name: text` (or `name (type): text`) line of that
section. The JSON schema of the parameters comes from pydantic (a model built from the signature), so
anything pydantic can validate can be a parameter type; parameters without a default are required,
unknown arguments are refused (`additionalProperties: false`).

`Toolbox.call` never raises for a model's mistake or a tool's failure: an unknown tool, arguments that
fail validation, an exception in the tool and a timeout each give `ToolResult(ok=False)` whose content
says what went wrong, written for the model to read. Sync tools run in a worker thread so the event
loop never blocks; a sync tool that overruns its timeout is abandoned, not stopped (a thread cannot be
killed), so a tool that may hang or runs untrusted input must be async and stoppable (the Python
sandbox kills its process).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.common.tool_calls import CallError, ParsedCall

MAX_RESULT_CHARS = 4000
_ARG_LINE = re.compile(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SECTION = re.compile(r"^(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")


@dataclass(frozen=True)
class ToolResult:
    """What one call gave: `content` is the text shown to the model (an error message when not ok)."""

    call_id: str
    name: str
    content: str
    ok: bool


def _parse_docstring(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    doc = inspect.cleandoc(fn.__doc__ or "")
    description: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    for line in doc.splitlines():
        header = _SECTION.match(line.strip())
        if header and not line.startswith((" ", "\t")):
            section, current = header.group(1), None
            continue
        if section is None:
            description.append(line)
        elif section in ("Args", "Arguments", "Parameters"):
            match = _ARG_LINE.match(line.strip())
            if match and not line.startswith(("     ", "\t\t")):
                current = match.group(1).lstrip("*")
                params[current] = match.group(2).strip()
            elif current and line.strip():
                params[current] = f"{params[current]} {line.strip()}".strip()
    return "\n".join(description).strip(), params


def _strip_titles(schema: Any) -> Any:
    """The schema without pydantic's generated "title" keys (tokens in every prompt, no information)."""
    if isinstance(schema, dict):
        return {
            k: (_strip_titles(v) if k != "properties" else {p: _strip_titles(s) for p, s in v.items()})
            for k, v in schema.items()
            if k != "title" or not isinstance(v, str)
        }
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


class _Tool:
    """One tool: the callable, its arguments model and its OpenAI-style definition."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        name = getattr(fn, "__name__", None)
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", name):
            raise ValueError(f"a tool needs a name of 1-64 letters, digits, _ . - (got {name!r})")
        self.fn, self.name = fn, name
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
        description, docs = _parse_docstring(fn)
        fields: dict[str, Any] = {}
        for param in inspect.signature(fn, eval_str=True).parameters.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
                raise ValueError(f"tool {name!r}: parameter {param.name!r} must be a named parameter")
            annotation = Any if param.annotation is param.empty else param.annotation
            default = ... if param.default is param.empty else param.default
            fields[param.name] = (annotation, Field(default, description=docs.get(param.name)))
        self.model: type[BaseModel] = pydantic.create_model(  # type: ignore[call-overload]
            f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
        )
        parameters = _strip_titles(self.model.model_json_schema())
        parameters.setdefault("properties", {})
        self.schema = {
            "type": "function",
            "function": {"name": name, "description": description, "parameters": parameters},
        }


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI-style definition of a tool: {"type": "function", "function": {name, description,
    parameters}}; raises ValueError for a callable that cannot be a tool (no name, *args/**kwargs)."""
    return _Tool(fn).schema


def _validation_message(name: str, error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False):
        field = ".".join(str(p) for p in item["loc"]) or "arguments"
        got = "" if item["type"] == "missing" else f" (got {json.dumps(item.get('input'), default=str)[:80]})"
        parts.append(f"{field}: {item['msg']}{got}")
    return f"error: invalid arguments for '{name}': " + "; ".join(parts)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _bounded(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated: {len(text) - limit} more characters]"


class Toolbox:
    """The tools an environment offers, by name."""

    def __init__(self, tools: Sequence[Callable[..., Any]], max_result_chars: int = MAX_RESULT_CHARS) -> None:
        if max_result_chars < 1:
            raise ValueError("max_result_chars must be positive")
        self._tools: dict[str, _Tool] = {}
        for fn in tools:
            tool = _Tool(fn)
            if tool.name in self._tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self._tools[tool.name] = tool
        self.max_result_chars = max_result_chars

    @property
    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema for tool in self._tools.values()]

    def tools_json(self) -> str:
        """The schemas as JSON text (Prompt.tools_json): the same text for the same tools, always."""
        return json.dumps(self.schemas(), ensure_ascii=False)

    async def call(self, call: ParsedCall, timeout: float) -> ToolResult:  # noqa: ASYNC109 (per-call bound)
        """Run one call within `timeout` seconds; never raises (except cancellation of the caller)."""
        tool = self._tools.get(call.name)
        if tool is None:
            available = ", ".join(sorted(self._tools)) or "none"
            return self._result(call, f"error: unknown tool '{call.name}'; available: {available}", False)
        try:
            arguments = tool.model.model_validate(call.arguments)
        except ValidationError as e:
            return self._result(call, _validation_message(tool.name, e), False)
        kwargs = {field: getattr(arguments, field) for field in type(arguments).model_fields}
        try:
            async with asyncio.timeout(timeout) as scope:
                if tool.is_async:
                    value = await tool.fn(**kwargs)
                else:
                    value = await asyncio.to_thread(functools.partial(tool.fn, **kwargs))
                    if inspect.isawaitable(value):
                        value = await value
        except TimeoutError as e:
            if scope.expired():
                return self._result(call, f"error: tool '{tool.name}' timed out after {timeout:g} s", False)
            return self._result(call, f"error: tool '{tool.name}' raised {_describe(e)}", False)
        except Exception as e:
            return self._result(call, f"error: tool '{tool.name}' raised {_describe(e)}", False)
        try:
            text = _as_text(value)
        except Exception as e:
            return self._result(
                call, f"error: the result of '{tool.name}' is not text: {_describe(e)}", False
            )
        return self._result(call, text, True)

    def _result(self, call: ParsedCall, content: str, ok: bool) -> ToolResult:
        return ToolResult(call.id, call.name, _bounded(content, self.max_result_chars), ok)


def _describe(error: BaseException) -> str:
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def tool_message(result: ToolResult) -> dict[str, str]:
    """The chat message that carries a result back to the model."""
    return {"role": "tool", "content": result.content, "tool_call_id": result.call_id, "name": result.name}


def error_message(err: CallError, id_prefix: str = "call") -> dict[str, str]:
    """The chat message that tells the model one of its calls was malformed (the block's id, no name)."""
    return {
        "role": "tool",
        "content": f"error: {err.message}",
        "tool_call_id": f"{id_prefix}_{err.index}",
        "name": "",
    }
