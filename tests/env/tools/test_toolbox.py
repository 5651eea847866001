"""Tools from Python callables: schemas from type hints and docstrings, and calls that never raise."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Literal

import pytest

from services.common.tool_calls import CallError, ParsedCall, parse_tool_calls
from services.env.tools import Toolbox, calculator, error_message, python, tool_message, tool_schema


def add(a: int, b: int = 2) -> int:
    """Add two integers.

    Use it for sums.

    Args:
        a: The first number.
        b (int): The second number,
            two by default.

    Returns:
        The sum.
    """
    return a + b


async def lookup(key: str, mode: Literal["exact", "prefix"] = "exact", tags: list[str] | None = None) -> dict:
    """Look a key up."""
    await asyncio.sleep(0)
    return {"key": key, "mode": mode, "tags": tags or []}


def fail(x: float) -> str:
    """Always fails."""
    raise RuntimeError(f"cannot handle {x}")


async def slow(seconds: float) -> str:
    """Sleeps."""
    await asyncio.sleep(seconds)
    return "done"


def slow_sync(seconds: float) -> str:
    """Sleeps in a thread."""
    time.sleep(seconds)
    return "done"


def raises_timeout() -> str:
    """Raises its own TimeoutError."""
    raise TimeoutError("upstream timed out")


def big() -> str:
    """A long result."""
    return "x" * 10_000


def call(name: str, **arguments: object) -> ParsedCall:
    return ParsedCall("call_0", name, dict(arguments), json.dumps(arguments))


def test_schema_from_type_hints_defaults_and_google_docstring() -> None:
    schema = tool_schema(add)
    assert schema == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.\n\nUse it for sums.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {
                        "type": "integer",
                        "default": 2,
                        "description": "The second number, two by default.",
                    },
                },
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    }
    params = tool_schema(lookup)["function"]["parameters"]
    assert params["required"] == ["key"]
    assert params["properties"]["mode"] == {"enum": ["exact", "prefix"], "type": "string", "default": "exact"}
    assert {"type": "array", "items": {"type": "string"}} in params["properties"]["tags"]["anyOf"]
    assert "title" not in json.dumps(params)
    assert tool_schema(calculator)["function"]["parameters"]["properties"]["expression"]["description"]
    assert "sandbox" in tool_schema(python)["function"]["description"]


def test_bad_tool_definitions_are_refused() -> None:
    def star(*args: int) -> int:
        return 0

    with pytest.raises(ValueError, match="must be a named parameter"):
        tool_schema(star)
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        Toolbox([add, add])


def test_tools_json_is_stable_and_is_the_schemas() -> None:
    first, second = Toolbox([add, lookup, calculator]), Toolbox([add, lookup, calculator])
    assert first.tools_json() == second.tools_json()
    assert json.loads(first.tools_json()) == first.schemas()
    assert first.names == ["add", "lookup", "calculator"] and "add" in first and "nope" not in first


async def test_sync_and_async_tools_and_result_conversion() -> None:
    box = Toolbox([add, lookup, calculator])
    assert await box.call(call("add", a=2, b="3"), timeout=5) == box._result(call("add"), "5", True)
    result = await box.call(call("lookup", key="k", tags=["t"]), timeout=5)
    assert result.ok and json.loads(result.content) == {"key": "k", "mode": "exact", "tags": ["t"]}
    result = await box.call(call("calculator", expression="123456789123456789 * 987654321987654321"), 5)
    assert result.ok and result.content == str(123456789123456789 * 987654321987654321)


async def test_unknown_tools_and_invalid_arguments_are_clear_errors() -> None:
    box = Toolbox([add, python])
    result = await box.call(call("foo"), timeout=5)
    assert not result.ok and result.content == "error: unknown tool 'foo'; available: add, python"
    result = await box.call(call("add", a="two"), timeout=5)
    assert not result.ok and result.content.startswith("error: invalid arguments for 'add': a: ")
    assert "valid integer" in result.content and '(got "two")' in result.content
    result = await box.call(call("add", b=1, c=3), timeout=5)
    assert "a: Field required" in result.content and "c: Extra inputs are not permitted" in result.content


async def test_exceptions_and_timeouts_become_errors() -> None:
    box = Toolbox([fail, slow, slow_sync, raises_timeout])
    result = await box.call(call("fail", x=1.5), timeout=5)
    assert not result.ok and result.content == "error: tool 'fail' raised RuntimeError: cannot handle 1.5"
    result = await box.call(call("slow", seconds=60), timeout=0.2)
    assert not result.ok and result.content == "error: tool 'slow' timed out after 0.2 s"
    result = await box.call(call("slow_sync", seconds=1), timeout=0.1)
    assert not result.ok and "'slow_sync' timed out" in result.content
    result = await box.call(call("raises_timeout"), timeout=5)  # its own TimeoutError is not a timeout
    assert result.content == "error: tool 'raises_timeout' raised TimeoutError: upstream timed out"


async def test_results_are_truncated_and_say_so() -> None:
    result = await Toolbox([big], max_result_chars=100).call(call("big"), timeout=5)
    assert result.ok and result.content.startswith("x" * 100)
    assert result.content.endswith("[truncated: 9900 more characters]") and len(result.content) < 150


async def test_a_sync_tool_does_not_block_the_event_loop() -> None:
    started = threading.Event()

    def blocking() -> str:
        """Blocks its thread."""
        started.set()
        time.sleep(0.5)
        return "ok"

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1 if started.is_set() else 0

    task = asyncio.create_task(ticker())
    result = await Toolbox([blocking]).call(call("blocking"), timeout=30)
    task.cancel()
    assert result.ok and ticks >= 5  # the loop kept running while the tool slept in its thread


def test_messages_for_results_and_malformed_calls() -> None:
    box_result = Toolbox([add])._result(call("add"), "3", True)
    assert tool_message(box_result) == {
        "role": "tool",
        "content": "3",
        "tool_call_id": "call_0",
        "name": "add",
    }
    turn = parse_tool_calls("<tool_call>{bad}</tool_call>", id_prefix="call_2")
    (err,) = turn.errors
    assert isinstance(err, CallError)
    message = error_message(err, id_prefix="call_2")
    assert message["role"] == "tool" and message["tool_call_id"] == "call_2_0"
    assert message["content"].startswith("error: malformed tool call 0: invalid JSON")
