"""The environment's multi-turn side over a real gRPC server: Respond (tools in the scoring workers),
scoring by transcripts, and every way an environment turn can fail without the service failing."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2

from .test_grpc import T, serve

TURN_ENV = str(Path(__file__).parent / "turn_envs.py") + ":ToolTurnEnv"


@pytest.fixture
async def turns():
    async for stubs in serve(spec=TURN_ENV, score_workers=1):
        yield stubs[0]


def assistant(text: str) -> types_pb2.Transcript:
    return types_pb2.Transcript(messages=[types_pb2.ChatMessage(role="assistant", content=text)])


async def _prompt(stub) -> types_pb2.Prompt:
    return (await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=1), timeout=T)).prompts[0]


async def test_describe_and_prompts_carry_the_turn_limits_and_the_tools(turns) -> None:
    d = await turns.DescribeEnvironment(env_pb2.DescribeEnvironmentRequest(), timeout=T)
    assert (d.max_turns, d.respond_timeout_seconds) == (3, 2.0)
    tools = json.loads(d.tools_json)
    assert [t["function"]["name"] for t in tools] == ["add", "slow"]
    assert tools[0]["function"]["parameters"]["required"] == ["a", "b"]
    assert (await _prompt(turns)).tools_json == d.tools_json


async def test_tool_calls_are_run_and_answered_and_no_call_ends_the_episode(turns) -> None:
    prompt = await _prompt(turns)
    call = '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 1000000007}}</tool_call>'
    bad = "<tool_call>{not json}</tool_call>"
    unknown = '<tool_call>{"name": "rm", "arguments": {}}</tool_call>'
    wrong_type = '<tool_call>{"name": "add", "arguments": {"a": "five", "b": 1}}</tool_call>'
    late = '<tool_call>{"name": "slow", "arguments": {}}</tool_call>'
    request = env_pb2.RespondRequest(
        prompt=prompt,
        transcripts=[assistant(call), assistant("The answer is 7."), assistant(bad), assistant(unknown),
                     assistant(wrong_type), assistant(late)],
    )  # fmt: skip
    replies = (await turns.Respond(request, timeout=T)).replies
    ok, done, malformed, missing, invalid, timed_out = replies
    assert not ok.done and [m.role for m in ok.messages] == ["tool"]
    assert ok.messages[0].content == "1000000012" and ok.messages[0].name == "add"
    assert (ok.tool_calls, ok.tool_errors) == (1, 0)
    assert done.done and not done.messages and done.tool_calls == 0
    for reply in (malformed, missing, invalid, timed_out):
        assert not reply.done and not reply.failure and reply.tool_errors == 1
        assert reply.messages[0].role == "tool" and reply.messages[0].content.startswith("error")
    assert "rm" in missing.messages[0].content and "a" in invalid.messages[0].content
    state = await turns.GetEnvironmentState(env_pb2.GetEnvironmentStateRequest(), timeout=T)
    assert state.metrics["env/tool_calls"] == 5 and state.metrics["env/tool_errors"] == 4


async def test_an_env_that_raises_or_hangs_fails_only_that_episode_and_keeps_serving(turns) -> None:
    prompt = await _prompt(turns)
    request = env_pb2.RespondRequest(prompt=prompt, transcripts=[assistant("raise"), assistant("feedback")])
    raised, feedback = (await turns.Respond(request, timeout=T)).replies
    assert raised.done and raised.failure.startswith("exception: ValueError: the env broke")
    assert feedback.messages[0].content == "Try again." and feedback.reward == 0.25 and not feedback.done
    hung = await turns.Respond(
        env_pb2.RespondRequest(prompt=prompt, transcripts=[assistant("hang")]), timeout=T
    )
    assert hung.replies[0].done and hung.replies[0].failure.startswith("timeout")  # worker killed, replaced
    again = await turns.Respond(
        env_pb2.RespondRequest(prompt=prompt, transcripts=[assistant("ok")]), timeout=T
    )
    assert again.replies[0].done and not again.replies[0].failure


async def test_transcripts_are_scored_by_their_final_answer_and_failed_episodes_fail(turns) -> None:
    prompt = await _prompt(turns)
    good = types_pb2.Transcript(
        messages=[
            types_pb2.ChatMessage(role="assistant", content="<tool_call>...</tool_call>"),
            types_pb2.ChatMessage(role="tool", content="x", tool_call_id="call_1_0", name="add"),
            types_pb2.ChatMessage(role="assistant", content=f"It is {prompt.reference_answer}."),
        ]
    )
    failed = types_pb2.Transcript(messages=good.messages, failure="token budget: too long")
    request = env_pb2.ScoreCompletionsRequest(prompt=prompt, transcripts=[good, assistant("no idea"), failed])
    scored = await turns.ScoreCompletions(request, timeout=T)
    assert list(scored.rewards) == [1.0, 0.0, 0.0]
    assert scored.reward_infos[2].details["failure_kind"] == "episode"
    assert "token budget" in scored.reward_infos[2].failure and scored.skip_group


@pytest.mark.parametrize(
    ("transcripts", "message"),
    [
        ([], "no transcripts"),
        ([types_pb2.Transcript()], "must end with the model's"),
        ([types_pb2.Transcript(messages=[types_pb2.ChatMessage(role="user", content="hi")])], "must end"),
    ],
)
async def test_bad_respond_requests_are_invalid_arguments(turns, transcripts, message) -> None:
    prompt = await _prompt(turns)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await turns.Respond(env_pb2.RespondRequest(prompt=prompt, transcripts=transcripts), timeout=T)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()
