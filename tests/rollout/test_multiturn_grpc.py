"""The rollout's side of multi-turn episodes over gRPC, on a real in-process server with the
transformers engine (tiny model): token-in generation, the one model turn of every completion,
RenderMessages in its three modes, and the engine's max_model_len in GetRolloutState."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2
from tests.rollout.test_rollout_grpc import TIMEOUT, Running, _close, _start, settings_for

pytestmark = pytest.mark.asyncio(loop_scope="module")
Msg = types_pb2.ChatMessage
MAX_LEN = 512  # the model's positions: the tools block alone is ~400 of the tiny tokenizer's tokens
TOOLS_JSON = json.dumps(
    [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir: Path):
    limits = {"max_render_messages": 8, "max_render_chars": 4000, "max_previous_tail": 16}
    settings = settings_for(tiny_model_dir, rollout_id="multiturn", limits=limits, max_model_len=MAX_LEN)
    started = await _start(settings)
    yield started
    await _close(started)


async def render(server: Running, mode: int, **fields) -> rollout_pb2.RenderMessagesResponse:
    request = rollout_pb2.RenderMessagesRequest(mode=mode, **fields)
    return await server.stub.RenderMessages(request, timeout=TIMEOUT)


def _ids(server: Running, text: str) -> list[int]:
    return server.app.rollout._tokenizer(text, add_special_tokens=False)["input_ids"]


def _key(completions) -> list[tuple]:
    return sorted((c.index, tuple(c.completion_token_ids), tuple(c.logprobs)) for c in completions)


def _turns(completion: types_pb2.Completion) -> list[tuple]:
    return [(t.source, t.start, t.end, t.finish_reason) for t in completion.turns]


async def test_token_in_continues_exactly_the_given_tokens(server: Running) -> None:
    """The tokens of a text prompt, given as prompt_token_ids (no text), sample what the text does
    under the same seed; the completions leave prompt_token_ids empty and carry one model turn."""
    sampling = dict(n=3, temperature=1.0, max_tokens=10, seed=11)
    by_text = await server.generate(types_pb2.Prompt(id="t", text="12+34="), **sampling)
    prompt_ids = list(by_text[0].prompt_token_ids)
    assert prompt_ids == server.app.rollout._tokenizer("12+34=")["input_ids"]
    request = rollout_pb2.GenerateRequest(
        request_id="token-in",
        prompt=types_pb2.Prompt(id="episode-1/turn-2"),
        sampling_params=types_pb2.SamplingParams(**sampling),
        prompt_token_ids=prompt_ids,
    )
    by_tokens = [c async for r in server.stub.Generate(request, timeout=TIMEOUT) for c in r.completions]
    assert _key(by_tokens) == _key(by_text)
    for c in by_tokens:
        assert c.prompt_id == "episode-1/turn-2" and not c.prompt_token_ids and c.rollout_id == "multiturn"
    for c in by_tokens + by_text:
        assert _turns(c) == [(types_pb2.TURN_SOURCE_MODEL, 0, len(c.completion_token_ids), c.finish_reason)]
        assert c.finish_reason != types_pb2.FINISH_REASON_UNSPECIFIED


async def test_token_in_in_a_batch(server: Running) -> None:
    prompt_ids = server.app.rollout._tokenizer("7*8=")["input_ids"]
    sampling = types_pb2.SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=3)
    requests = [
        rollout_pb2.GenerateRequest(
            request_id="text", prompt=types_pb2.Prompt(id="a", text="7*8="), sampling_params=sampling
        ),
        rollout_pb2.GenerateRequest(
            request_id="tokens",
            prompt=types_pb2.Prompt(id="b"),
            sampling_params=sampling,
            prompt_token_ids=prompt_ids,
        ),
        rollout_pb2.GenerateRequest(
            request_id="too-long",
            prompt=types_pb2.Prompt(id="c"),
            sampling_params=sampling,
            prompt_token_ids=[1] * (MAX_LEN - 5),
        ),
    ]
    got: dict[str, list] = {}
    errors = {}
    call = server.stub.GenerateBatch(rollout_pb2.GenerateBatchRequest(requests=requests), timeout=TIMEOUT)
    async for response in call:
        for result in response.results:
            if result.HasField("error"):
                errors[result.request_id] = result.error
            got.setdefault(result.request_id, []).extend(result.completions)
    assert _key(got["tokens"]) == _key(got["text"])
    assert all(not c.prompt_token_ids for c in got["tokens"])
    assert all(list(c.prompt_token_ids) == prompt_ids for c in got["text"])
    assert all(len(c.turns) == 1 for c in got["tokens"] + got["text"])
    assert errors["too-long"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert f"prompt_token_ids has {MAX_LEN - 5} tokens" in errors["too-long"].message


@pytest.mark.parametrize(
    ("ids", "max_tokens", "needle"),
    [
        ([1, 10**6, 2], 4, "prompt_token_ids[1] = 1000000 is outside the vocabulary"),
        ([1, -1], 4, "prompt_token_ids[1] = -1 is outside the vocabulary"),
        ([1] * (MAX_LEN - 6), 7, f"more than max_model_len {MAX_LEN}"),
    ],
)
async def test_invalid_token_in(server: Running, ids: list[int], max_tokens: int, needle: str) -> None:
    request = rollout_pb2.GenerateRequest(
        request_id="bad",
        prompt=types_pb2.Prompt(id="bad"),
        sampling_params=types_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens),
        prompt_token_ids=ids,
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in server.stub.Generate(request, timeout=TIMEOUT)]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


async def test_token_in_may_fill_the_context_exactly(server: Running) -> None:
    """prompt + max_tokens == max_model_len is accepted (the whole context is usable)."""
    request = rollout_pb2.GenerateRequest(
        request_id="full",
        prompt=types_pb2.Prompt(id="full"),
        sampling_params=types_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=6, seed=1),
        prompt_token_ids=[1] * (MAX_LEN - 6),
    )
    completions = [c async for r in server.stub.Generate(request, timeout=TIMEOUT) for c in r.completions]
    assert len(completions) == 1 and 1 <= len(completions[0].completion_token_ids) <= 6


async def test_state_reports_max_model_len(server: Running) -> None:
    assert (await server.state()).max_model_len == MAX_LEN


async def test_render_conversation_is_what_generate_renders(server: Running) -> None:
    """A conversation (with tools) renders to the tokens Generate uses for the same chat prompt."""
    messages = [Msg(role="system", content="Add."), Msg(role="user", content="1+2?")]
    rendered = await render(
        server, rollout_pb2.RENDER_MODE_CONVERSATION, messages=messages, tools_json=TOOLS_JSON,
        add_generation_prompt=True,
    )  # fmt: skip
    prompt = types_pb2.Prompt(id="chat", messages=messages, tools_json=TOOLS_JSON)
    completions = await server.generate(prompt, n=1, temperature=1.0, max_tokens=2)
    assert list(rendered.token_ids) == list(completions[0].prompt_token_ids)
    assert rendered.text == server.app.rollout._tokenizer.decode(list(rendered.token_ids))
    assert rendered.text.startswith(
        "<|im_start|>system\nAdd.\n\n# Tools\n"
    )  # the tiny template ignores tools
    assert rendered.text.endswith("<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n")
    plain = await render(server, rollout_pb2.RENDER_MODE_CONVERSATION, messages=messages)
    assert plain.text == "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+2?<|im_end|>\n"


async def test_render_bridge_extends_an_episode_token_exactly(server: Running) -> None:
    """prompt + the model's turn (ended by <|im_end|>, or cut off) + bridge == the whole conversation's
    render, for tool results (with tool calls, ids and names) and a user message."""
    im_end = server.app.rollout._tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompt = [Msg(role="user", content="What is 123+456?")]
    reply = '<tool_call>\n{"name": "add", "arguments": {"a": 123, "b": 456}}\n</tool_call>'
    call = types_pb2.ToolCall(id="call_0_0", name="add", arguments_json='{"a": 123, "b": 456}')
    env = [
        Msg(role="tool", content="579", tool_call_id="call_0_0", name="add"),
        Msg(role="user", content="ok?"),
    ]
    first = await render(
        server, rollout_pb2.RENDER_MODE_CONVERSATION, messages=prompt, tools_json=TOOLS_JSON,
        add_generation_prompt=True,
    )  # fmt: skip
    whole = await render(
        server, rollout_pb2.RENDER_MODE_CONVERSATION, tools_json=TOOLS_JSON, add_generation_prompt=True,
        messages=[*prompt, Msg(role="assistant", content=reply, tool_calls=[call]), *env],
    )  # fmt: skip
    for sampled in ([*_ids(server, reply), im_end], _ids(server, reply)):
        bridge = await render(
            server, rollout_pb2.RENDER_MODE_BRIDGE, messages=env, previous_tail=sampled[-3:],
            add_generation_prompt=True,
        )  # fmt: skip
        assert list(first.token_ids) + sampled + list(bridge.token_ids) == list(whole.token_ids)
        assert bridge.text.endswith("<|im_start|>user\nok?<|im_end|>\n<|im_start|>assistant\n")
        assert "<tool_response>\n579\n</tool_response>" in bridge.text


async def test_render_text(server: Running) -> None:
    rendered = await render(server, rollout_pb2.RENDER_MODE_TEXT, text="<|im_start|>user\n12+34=")
    assert list(rendered.token_ids) == _ids(server, "<|im_start|>user\n12+34=")
    assert rendered.text == "<|im_start|>user\n12+34="


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (dict(messages=[Msg(role="user", content="x")]), "mode must be RENDER_MODE_CONVERSATION"),
        (dict(mode=rollout_pb2.RENDER_MODE_CONVERSATION), "messages is empty"),
        (dict(mode=rollout_pb2.RENDER_MODE_BRIDGE), "messages is empty"),
        (dict(mode=rollout_pb2.RENDER_MODE_TEXT), "text is empty"),
        (
            dict(mode=rollout_pb2.RENDER_MODE_CONVERSATION, messages=[Msg(role="robot", content="x")]),
            "messages[0].role must be one of",
        ),
        (
            dict(
                mode=rollout_pb2.RENDER_MODE_CONVERSATION,
                messages=[Msg(role="user", content="x")],
                tools_json="[{",
            ),
            "tools_json is not valid JSON",
        ),
        (
            dict(
                mode=rollout_pb2.RENDER_MODE_BRIDGE,
                messages=[
                    Msg(
                        role="assistant",
                        tool_calls=[types_pb2.ToolCall(id="c", name="add", arguments_json="{a")],
                    )
                ],
            ),
            "messages[0].tool_calls[0].arguments_json is not valid JSON",
        ),
        (
            dict(mode=rollout_pb2.RENDER_MODE_CONVERSATION, messages=[Msg(role="user", content="x")] * 9),
            "messages has 9 messages (max 8)",
        ),
        (
            dict(mode=rollout_pb2.RENDER_MODE_CONVERSATION, messages=[Msg(role="user", content="x" * 4001)]),
            "renders 4001 characters (max 4000",
        ),
        (dict(mode=rollout_pb2.RENDER_MODE_TEXT, text="x" * 4001), "renders 4001 characters"),
        (
            dict(
                mode=rollout_pb2.RENDER_MODE_BRIDGE,
                messages=[Msg(role="user", content="x")],
                previous_tail=[10**6],
            ),
            "previous_tail[0] = 1000000 is outside the vocabulary",
        ),
        (
            dict(
                mode=rollout_pb2.RENDER_MODE_BRIDGE,
                messages=[Msg(role="user", content="x")],
                previous_tail=[1] * 17,
            ),
            "previous_tail has 17 tokens (max 16)",
        ),
    ],
)
async def test_invalid_render_requests(server: Running, fields: dict, needle: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await server.stub.RenderMessages(rollout_pb2.RenderMessagesRequest(**fields), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()
    assert (await server.state()).status == rollout_pb2.ROLLOUT_STATUS_READY  # still serving
