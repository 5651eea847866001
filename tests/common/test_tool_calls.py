"""Hermes tool calls: parsing the model's text, rendering calls back, and never raising on garbage."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.tool_calls import (
    MAX_BLOCK_CHARS,
    MAX_CALLS,
    SUPPORTED_FORMATS,
    ParsedCall,
    parse_tool_calls,
    render_tool_calls,
)


def test_no_calls_is_all_content() -> None:
    turn = parse_tool_calls("  The answer is 4.\n")
    assert turn.content == "The answer is 4." and turn.calls == () and turn.errors == ()
    assert SUPPORTED_FORMATS == ("hermes",)


def test_calls_anywhere_with_whitespace_and_string_arguments() -> None:
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2**10"}}\n</tool_call>'
        ' and then <tool_call>{"name":"python","arguments":"{\\"code\\": \\"print(1)\\"}"}</tool_call>\n'
        '<tool_call>  {"name": "now"}  </tool_call> done'
    )
    turn = parse_tool_calls(text, id_prefix="call_3")
    assert turn.errors == ()
    assert turn.content == "Let me compute.\n and then \n done"
    assert [(c.id, c.name, c.arguments) for c in turn.calls] == [
        ("call_3_0", "calculator", {"expression": "2**10"}),
        ("call_3_1", "python", {"code": "print(1)"}),
        ("call_3_2", "now", {}),
    ]
    assert json.loads(turn.calls[0].arguments_json) == {"expression": "2**10"}


def test_a_closing_tag_inside_a_json_string_does_not_end_the_block() -> None:
    text = '<tool_call>{"name": "echo", "arguments": {"s": "a</tool_call>b"}}</tool_call>'
    turn = parse_tool_calls(text)
    assert turn.errors == () and turn.calls[0].arguments == {"s": "a</tool_call>b"} and turn.content == ""


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ('{"name": "f", "arguments": {"x": 1,}}', "invalid JSON: Expecting property name"),
        ('["f", {}]', "got a JSON array"),
        ('{"arguments": {}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', '"name" is empty'),
        ('{"name": 7, "arguments": {}}', '"name" is a JSON number'),
        ('{"name": "f", "arguments": [1, 2]}', '"arguments" must be a JSON object, got a JSON array'),
        ('{"name": "f", "arguments": "[1]"}', '"arguments" must be a JSON object, got a JSON array'),
        ('{"name": "f", "arguments": "{oops"}', '"arguments" is a string that is not valid JSON'),
        ('{"name": "f", "arguments": {"x": NaN}}', "NaN is not valid JSON"),
        ('{"name": "f"} trailing', "unexpected text after the JSON object: 'trailing"),
        ("[" * 100_000, "characters long, at most"),
        ("[" * 5000 + "]" * 5000, "invalid JSON: nested too deeply"),
        ("[" * 50 + "]" * 50, "got a JSON array"),
    ],
)
def test_malformed_blocks_become_errors_with_a_precise_message(block: str, expected: str) -> None:
    text = f'ok <tool_call>{block}</tool_call> <tool_call>{{"name": "g"}}</tool_call>'
    turn = parse_tool_calls(text)
    assert len(turn.errors) == 1, turn.errors
    err = turn.errors[0]
    assert err.index == 0 and expected in err.message, err.message
    assert err.message.startswith("malformed tool call 0: ") and '"arguments"' in err.message
    assert len(err.raw) < 700
    assert [(c.id, c.name) for c in turn.calls] == [("call_1", "g")]  # the good one still runs
    assert turn.content == "ok"


def test_an_unterminated_block_at_the_end_is_an_error() -> None:
    turn = parse_tool_calls('thinking <tool_call>{"name": "f", "arguments": {"x": ')
    assert turn.calls == () and turn.content == "thinking"
    assert "<tool_call> is never closed by </tool_call>" in turn.errors[0].message
    complete_json = parse_tool_calls('<tool_call>{"name": "f"}')  # valid JSON, no closing tag
    assert "never closed" in complete_json.errors[0].message


def test_more_than_the_maximum_calls_give_one_error() -> None:
    text = "".join(f'<tool_call>{{"name": "f{i}"}}</tool_call>' for i in range(MAX_CALLS + 5))
    turn = parse_tool_calls(text)
    assert len(turn.calls) == MAX_CALLS
    assert len(turn.errors) == 1 and turn.errors[0].index == MAX_CALLS
    assert f"{MAX_CALLS + 5} in one turn, at most {MAX_CALLS}" in turn.errors[0].message
    assert "last 5 were not run" in turn.errors[0].message


def test_a_block_over_the_bound_is_rejected_without_parsing() -> None:
    big = json.dumps({"name": "f", "arguments": {"s": "x" * MAX_BLOCK_CHARS}})
    turn = parse_tool_calls(f"<tool_call>{big}</tool_call>")
    assert turn.calls == () and "at most 65536" in turn.errors[0].message


def test_render_is_qwen_templates_text_and_accepts_openai_and_proto_shapes() -> None:
    calls = [ParsedCall("call_0", "calculator", {"expression": "1+1"}, '{"expression": "1+1"}')]
    assert render_tool_calls(calls) == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
    )
    openai = [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": "é"}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    assert render_tool_calls(openai) == (
        '<tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    )

    class ProtoLike:  # the shape of grpo.common.v1.ToolCall
        name = "f"
        arguments_json = '{"x": 1}'

    assert '"arguments": {"x": 1}' in render_tool_calls([ProtoLike()])
    with pytest.raises(ValueError, match="arguments is not valid JSON"):
        render_tool_calls([{"function": {"name": "f", "arguments": "{bad"}}])
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        render_tool_calls([{"function": {"arguments": "{}"}}])


# Qwen2.5-Instruct's chat template, assistant messages only (its tool-call lines verbatim).
QWEN25_ASSISTANT = """{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}"""


def test_render_matches_what_qwen25s_template_writes() -> None:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template(QWEN25_ASSISTANT)
    arguments = [{"expression": "12 * (3 + 4)", "note": "é ünïcode", "n": [1, 2.5, None, True]}, {}]
    tool_calls = [
        {"type": "function", "function": {"name": name, "arguments": args}}
        for name, args in zip(["calculator", "now"], arguments, strict=True)
    ]
    expected = template.render(messages=[{"role": "assistant", "content": "", "tool_calls": tool_calls}])
    calls = [
        ParsedCall(f"c{i}", c["function"]["name"], a, json.dumps(a))
        for i, (c, a) in enumerate(zip(tool_calls, arguments, strict=True))
    ]
    assert expected == "<|im_start|>assistant\n" + render_tool_calls(calls) + "<|im_end|>\n"
    turn = parse_tool_calls(expected.removeprefix("<|im_start|>assistant").removesuffix("<|im_end|>\n"))
    assert [(c.name, c.arguments) for c in turn.calls] == list(
        zip(["calculator", "now"], arguments, strict=True)
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(), children, max_size=3),
    max_leaves=8,
)
calls_strategy = st.lists(
    st.tuples(st.text(min_size=1, max_size=20).filter(str.strip), st.dictionaries(st.text(), json_values)),
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(calls_strategy, st.text(max_size=50))
def test_render_then_parse_round_trips(calls: list[tuple[str, dict]], prefix: str) -> None:
    parsed = [ParsedCall(f"c{i}", n, a, json.dumps(a)) for i, (n, a) in enumerate(calls)]
    turn = parse_tool_calls(prefix.replace("<tool_call>", "") + render_tool_calls(parsed))
    assert turn.errors == ()
    assert [(c.name, c.arguments) for c in turn.calls] == [(n, a) for n, a in calls]


fragments = st.sampled_from(
    ["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", '"f"', "[", "]", "\\", '"']
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.text(max_size=10) | fragments, max_size=40).map("".join))
def test_parse_never_raises_on_arbitrary_text(text: str) -> None:
    turn = parse_tool_calls(text)
    assert len(turn.calls) + len(turn.errors) <= text.count("<tool_call>")
    for err in turn.errors:
        assert err.message
