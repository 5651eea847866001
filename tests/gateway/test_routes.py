"""Every route of the gateway against real rollouts (tiny model), over real HTTP; the official `openai`
client against it; tool calls from a completion back into the next request."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from gateway.support import MAX_MODEL_LEN, gateway
from grpo.common.v1 import types_pb2
from services.gateway import responses

pytestmark = pytest.mark.asyncio(loop_scope="package")

USER = [{"role": "user", "content": "What is 2+2?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def gw(rollouts):
    async with gateway([r.address for r in rollouts]) as (running, client):
        yield running, client


def _check_choice(choice: dict, max_tokens: int) -> None:
    assert 1 <= len(choice["token_ids"]) <= max_tokens
    spans = choice["weight_versions"]
    assert spans == [{"version": 0, "start": 0, "end": len(choice["token_ids"])}]
    assert choice["finish_reason"] in ("stop", "length")


async def test_models_and_health(gw) -> None:
    _, client = gw
    models = (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "grpo-mesh" and models["data"][0]["object"] == "model"
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert (await client.get("/health")).status_code == 200


async def test_chat_returns_tokens_logprobs_and_versions(gw, tokenizer) -> None:
    _, client = gw
    body = {"messages": USER, "n": 2, "max_tokens": 8, "seed": 5, "logprobs": True, "return_token_ids": True}
    reply = (await client.post("/v1/chat/completions", json=body)).json()
    text = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert reply["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for choice in reply["choices"]:
        _check_choice(choice, 8)
        content = choice["logprobs"]["content"]
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert all(e["logprob"] <= 0 for e in content)
        assert choice["message"]["role"] == "assistant"
    generated = sum(len(c["token_ids"]) for c in reply["choices"])
    assert reply["usage"] == {
        "prompt_tokens": len(reply["prompt_token_ids"]),
        "completion_tokens": generated,
        "total_tokens": len(reply["prompt_token_ids"]) + generated,
    }
    tokens = (await client.post("/tokenize", json={"messages": USER})).json()
    assert tokens["tokens"] == reply["prompt_token_ids"] and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == MAX_MODEL_LEN


async def test_completions_text_and_token_in(gw, tokenizer) -> None:
    _, client = gw
    body = {"prompt": "12+34=", "n": 3, "max_tokens": 6, "logprobs": 0, "return_token_ids": True}
    reply = (await client.post("/v1/completions", json=body)).json()
    assert reply["object"] == "text_completion" and len(reply["choices"]) == 3
    assert reply["prompt_token_ids"] == tokenizer("12+34=")["input_ids"]
    for choice in reply["choices"]:
        _check_choice(choice, 6)
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    ids = reply["prompt_token_ids"] + reply["choices"][0]["token_ids"]
    again = await client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 4, "return_token_ids": True}
    )
    assert again.json()["prompt_token_ids"] == ids
    assert (await client.post("/tokenize", json={"prompt": "12+34="})).json()["tokens"] == reply[
        "prompt_token_ids"
    ]


async def test_token_in_generate_route(gw) -> None:
    _, client = gw
    body = {
        "model": "grpo-mesh",
        "token_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": 5, "n": 2, "seed": 1},
    }
    reply = (await client.post("/inference/v1/generate", json=body)).json()
    assert reply["request_id"] and len(reply["choices"]) == 2
    for choice in reply["choices"]:
        _check_choice(choice, 5)
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert reply["usage"]["prompt_tokens"] == 4


async def test_rollout_refusal_is_a_400_naming_the_rollout(gw) -> None:
    _, client = gw
    body = {"token_ids": [10**6], "sampling_params": {"max_tokens": 2}}
    reply = await client.post("/inference/v1/generate", json=body)
    assert reply.status_code == 400
    assert "vocabulary" in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": USER, "n": "2"}, "n"),
        ("/v1/chat/completions", {"messages": USER, "temperature": 0}, "temperature"),
        ("/v1/chat/completions", {"messages": USER, "top_logprobs": 3}, "top_logprobs"),
        (
            "/v1/chat/completions",
            {"messages": USER, "tool_choice": "required", "tools": TOOLS},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "model": "gpt-4"}, "model"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
        ("/v1/completions", {"prompt": [1, -1]}, "prompt[1]"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"n": 999}}, "sampling_params.n"),
        ("/tokenize", {"prompt": 3}, "prompt"),
    ],
)
async def test_client_mistakes_name_the_field(gw, path: str, body: dict, param: str) -> None:
    _, client = gw
    reply = await client.post(path, json=body)
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == "invalid_request_error"


async def test_openai_client_is_compatible(gw) -> None:
    running, _ = gw
    client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
    chat = await client.chat.completions.create(
        model="grpo-mesh", messages=USER, max_tokens=6, n=2, logprobs=True, seed=3,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert len(chat.choices) == 2
    extra = chat.model_extra or {}
    assert extra["prompt_token_ids"]
    for choice in chat.choices:
        token_ids = (choice.model_extra or {})["token_ids"]
        assert choice.logprobs is not None and len(choice.logprobs.content) == len(token_ids)
        assert isinstance(choice.logprobs.content[0].logprob, float)
    done = await client.completions.create(model="grpo-mesh", prompt="7*8=", max_tokens=4, logprobs=0)
    assert done.choices[0].logprobs is not None and done.usage is not None
    models = await client.models.list()
    assert [m.id for m in models.data] == ["grpo-mesh"]
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="grpo-mesh", messages=USER, temperature=0.0)
    assert info.value.body["param"] == "temperature"  # type: ignore[index]
    await client.close()


async def test_tool_calls_round_trip(gw, tokenizer) -> None:
    """A completion with a hermes tool call becomes message.tool_calls + finish_reason "tool_calls";
    sent back with the tool's answer, the next request renders both (in the tokens the rollout uses)."""
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    completion = types_pb2.Completion(index=0, text=text, finish_reason=types_pb2.FINISH_REASON_STOP)
    message, finish = responses.chat_message(completion, True, "call_x_0")
    assert finish == "tool_calls" and message["content"] == "Let me add."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 2}
    assert responses.chat_message(completion, False, "p")[0]["content"] == text  # tool_choice "none"

    _, client = gw
    conversation = [
        *USER,
        message,
        {"role": "tool", "tool_call_id": call["id"], "name": "add", "content": "4"},
    ]
    reply = await client.post("/tokenize", json={"messages": conversation, "tools": TOOLS})
    assert reply.status_code == 200, reply.text
    rendered = tokenizer.decode(reply.json()["tokens"])
    assert '"name": "add"' in rendered and "<tool_response>\n4" in rendered and "# Tools" in rendered
    # the same conversation to the chat route: rendered the same way, too long for the tiny context
    body = {"messages": conversation, "tools": TOOLS, "max_tokens": 4}
    refused = await client.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    assert str(reply.json()["count"]) in refused.json()["error"]["message"]


async def test_a_first_chat_call_rendered_by_generate_matches_the_rendered_prompt(gw) -> None:
    """A chat call that continues nothing is one Generate (the rollout renders it): its prompt is
    exactly what /tokenize renders; a prompt + max_tokens that does not fit is a 400 naming max_tokens,
    a prompt longer than the context one naming messages (tests/rollout check that Generate and
    RenderMessages render alike with tools too)."""
    _, client = gw
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    body = {"messages": messages, "max_tokens": 4, "return_token_ids": True}
    answer = await client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    rendered = await client.post("/tokenize", json={"messages": messages})
    assert reply["prompt_token_ids"] == rendered.json()["tokens"]
    long = [{"role": "user", "content": "1+1= " * 40}]
    count = (await client.post("/tokenize", json={"messages": long})).json()["count"]
    too_long = {"messages": long, "max_tokens": MAX_MODEL_LEN - count + 1}
    refused = await client.post("/v1/chat/completions", json=too_long)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    longer = {"messages": [{"role": "user", "content": "1+1= " * 100}], "max_tokens": 4}
    refused = await client.post("/v1/chat/completions", json=longer)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text
