"""The `tool_arithmetic` built-in: deterministic long-number problems, the calculator turn, reward on the
final answer only (a tool call alone earns nothing)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.env.base import Message, Score
from services.env.builtins.tool_arithmetic import (
    ToolArithmeticEnv,
    ToolArithmeticOptions,
    calculator_call,
    final_answer,
    problem_at,
)
from services.env.episodes import tools_json
from services.env.loader import EnvLoadError, load_environment


def _env(**options: object) -> ToolArithmeticEnv:
    env = load_environment("tool_arithmetic", dict(options))
    assert isinstance(env, ToolArithmeticEnv)
    return env


def _assistant(text: str) -> Message:
    return {"role": "assistant", "content": text}


def test_prompts_are_deterministic_and_long() -> None:
    env, again = _env(), _env()
    first = [env.prompt_at("train", i) for i in range(20)]
    assert first == [again.prompt_at("train", i) for i in range(20)]
    assert [p.id for p in first][:2] == ["tool_arithmetic-train-0", "tool_arithmetic-train-1"]
    for item in first:
        left, op, right = item.metadata["expression"].split(" ")
        assert op == "+" and len(left) == len(right) == 5  # exactly `digits` digits
        assert int(item.reference_answer) == int(left) + int(right)
        assert item.messages[-1] == {
            "role": "user",
            "content": f"What is {left} + {right}? Use a <tool_call>.",
        }
        assert item.messages[0]["role"] == "system" and "calculator" in item.messages[0]["content"]
    assert [p.metadata for p in first] != [_env(seed=1).prompt_at("train", i).metadata for i in range(20)]
    assert env.prompt_at("eval", 0).metadata != env.prompt_at("train", 0).metadata
    assert env.split_size("train") == 0 and env.split_size("eval") == 200
    assert env.turn_limit == 3


def test_precedence_and_options() -> None:
    options = ToolArithmeticOptions(digits=3, terms=4, operators="+-*", seed=5)
    for index in range(30):
        expression, result = problem_at(options, "train", index)
        assert result == eval(expression)  # plain integers and + - *: Python's precedence is the task's
    env = _env(
        digits=2, terms=3, max_turns=5, system_prompt=None, question="Compute {expression}.", few_shot=0
    )
    item = env.prompt_at("train", 0)
    assert len(item.messages) == 1 and item.messages[0]["content"].startswith("Compute ")
    assert env.turn_limit == 5


def test_few_shot_exchanges_come_before_the_question() -> None:
    one = _env(few_shot=1).prompt_at("train", 0).messages
    assert [m["role"] for m in one] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert one[1]["content"] == "What is 2048 + 1931? Use a <tool_call>."  # the examples ask the same way
    assert one[2]["content"] == calculator_call("2048 + 1931") and one[3]["content"] == "3979"
    default = _env().prompt_at("train", 0).messages  # two exchanges by default
    assert len(default) == 10 and default[-1] == one[-1]
    assert default[6]["content"] == calculator_call("123 + 456") and default[7]["content"] == "579"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"digits": 0}, "digits: Input should be greater than or equal to 1"),
        ({"operators": "+/"}, "unsupported operator"),
        ({"operators": ""}, "operators must not be empty"),
        ({"question": "What is it?"}, "question must contain '{expression}'"),
        ({"max_turns": 0}, "max_turns: Input should be greater than or equal to 1"),
        ({"few_shot": 3}, "few_shot: Input should be less than or equal to 2"),
        ({"tools": 1}, "unknown option 'tools'"),
    ],
)
def test_bad_options_are_rejected(options: dict[str, object], message: str) -> None:
    with pytest.raises(EnvLoadError, match="valid options") as caught:
        _env(**options)
    assert message in str(caught.value)


def test_final_answer_reads_the_last_integer_outside_tool_calls() -> None:
    assert final_answer("The answer is 45352.") == "45352"
    assert final_answer("19115 + 26237 = 45,352") == "45352"
    assert final_answer(calculator_call("19115 + 26237")) is None
    assert final_answer("It is 7. " + calculator_call("1 + 2")) == "7"
    assert final_answer('<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"') is None
    assert final_answer("no number") is None


def test_scoring_pays_the_right_final_answer_only() -> None:
    env = _env()
    item = env.prompt_at("train", 0)
    answer = int(item.reference_answer)
    call = calculator_call(item.metadata["expression"])
    tool = {"role": "tool", "content": str(answer), "name": "calculator", "tool_call_id": "call_1_0"}
    episodes = [
        [_assistant(call), tool, _assistant(f"The answer is {answer}.")],
        [_assistant(f"The answer is {answer}.")],  # right without the tool: paid the same
        [_assistant(call), tool, _assistant(f"The answer is {answer + 1}.")],
        [_assistant(call), tool, _assistant(call)],  # calls only: nothing
        [],
    ]
    scores = asyncio.run(env.score_episodes(item, episodes))
    assert all(isinstance(s, Score) for s in scores)
    assert [s.reward for s in scores if isinstance(s, Score)] == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [s.details["tool_messages"] for s in scores if isinstance(s, Score)] == ["1", "0", "1", "1", "0"]
    assert env.score_one(item, f"so {answer}").reward == 1.0


def test_respond_runs_the_calculator_exactly() -> None:
    env = _env(digits=12, operators="*")
    item = env.prompt_at("train", 3)
    reply = asyncio.run(env.respond(item, [_assistant(calculator_call(item.metadata["expression"]))]))
    assert not reply.done and reply.tool_calls == 1 and reply.tool_errors == 0
    [message] = reply.messages
    assert message["role"] == "tool" and message["name"] == "calculator"
    assert message["content"] == item.reference_answer  # a 24-digit product, exact


def test_respond_turns_a_malformed_call_into_an_error_message() -> None:
    env = _env()
    item = env.prompt_at("train", 0)
    for text in [
        '<tool_call>{"name": "calculator", "arguments": </tool_call>',
        '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": 19115}}</tool_call>',
    ]:
        reply = asyncio.run(env.respond(item, [_assistant(text)]))
        assert not reply.done, text
        assert reply.tool_calls == 1 and reply.tool_errors == 1, text
        [message] = reply.messages
        assert message["role"] == "tool" and "error" in message["content"].lower(), text


def test_respond_ends_the_episode_without_a_call() -> None:
    env = _env()
    item = env.prompt_at("train", 0)
    reply = asyncio.run(env.respond(item, [_assistant("The answer is 5.")]))
    assert reply.done and reply.messages == [] and reply.tool_calls == 0


def test_tools_schema() -> None:
    [tool] = json.loads(tools_json(_env()))
    assert tool["type"] == "function" and tool["function"]["name"] == "calculator"
    assert tool["function"]["parameters"]["required"] == ["expression"]
    # one short line: the prompt's length is what a learner step costs (the shared tool's is ~90 tokens)
    assert tool["function"]["description"] == "Evaluate an arithmetic expression exactly."
    assert len(tools_json(_env())) < 400
