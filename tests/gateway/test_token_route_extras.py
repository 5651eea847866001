"""The token-in route's vLLM extras that verifiers' `renderers` client sends on every call
(`sampling_params.logprobs = 1`, `sampling_params.stop_token_ids`), against a real rollout (tiny model):
logprobs 0 and 1 are served (the sampled token's), more is refused; stop_token_ids end each choice at its
first stop token, exactly as an engine stopping there would have (same tokens, logprobs, versions), and
the registry and the session hold what was answered."""

from __future__ import annotations

import pytest
import pytest_asyncio

from gateway.support import ListRecorder, gateway
from grpo.common.v1 import types_pb2
from services.gateway.stop_tokens import MAX_STOP_TOKEN_IDS, cut_at_stop_token

pytestmark = pytest.mark.asyncio(loop_scope="package")

PROMPT = [5, 6, 7]


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def gw(rollouts):
    recorder = ListRecorder()
    # one rollout: a seeded request sampled twice must meet the same weights and the same engine
    async with gateway([rollouts[0].address], recorder=recorder) as (running, client):
        yield running, client, recorder


def body(**sampling) -> dict:
    return {"token_ids": PROMPT, "sampling_params": {"max_tokens": 4, **sampling}}


async def test_logprobs_0_and_1_are_served_more_is_refused(gw) -> None:
    _, client, _ = gw
    for value in (0, 1):
        answer = await client.post("/inference/v1/generate", json=body(logprobs=value))
        assert answer.status_code == 200, (value, answer.text)
        choice = answer.json()["choices"][0]
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"]) >= 1
        assert all(entry["logprob"] <= 0.0 for entry in choice["logprobs"]["content"])
    for value in (2, 5, -1):
        refused = await client.post("/inference/v1/generate", json=body(logprobs=value))
        assert refused.status_code == 400, (value, refused.text)
        error = refused.json()["error"]
        assert error["param"] == "sampling_params.logprobs" and "send 0 or 1" in error["message"], error


async def test_stop_token_ids_end_a_choice_where_an_engine_stopping_there_would(gw) -> None:
    running, client, recorder = gw
    # an unconstrained seeded sample of at least 4 tokens (seeds tried in order until one gives it)
    for seed in range(1, 40):
        free = await client.post("/inference/v1/generate", json=body(max_tokens=10, seed=seed, logprobs=1))
        assert free.status_code == 200, free.text
        full = free.json()["choices"][0]
        if len(full["token_ids"]) >= 4:
            break
    else:
        pytest.fail("no seed gave 4 tokens")
    tokens = full["token_ids"]
    stop_token = tokens[2]
    end = tokens.index(stop_token) + 1  # the first occurrence ends it (<= 3 < len(tokens))
    session = {"X-Session-ID": "renderers-1"}
    answer = await client.post(
        "/inference/v1/generate",
        json=body(max_tokens=10, seed=seed, logprobs=1, stop_token_ids=[stop_token, 383]),
        headers=session,
    )
    assert answer.status_code == 200, answer.text
    cut = answer.json()["choices"][0]
    assert cut["token_ids"] == tokens[:end] and end < len(tokens)
    assert cut["logprobs"]["content"] == full["logprobs"]["content"][:end]
    assert cut["finish_reason"] == "stop"
    assert sum(v["end"] - v["start"] for v in cut["weight_versions"]) == end
    # the registry holds the generation that was answered, not what the rollout sampled past the stop
    registry = running.app.gateway.registry
    held = registry.get(PROMPT + tokens[:end], len(PROMPT), len(PROMPT) + end)
    assert held is not None and held.token_ids == tuple(tokens[:end])
    assert held.finish_reason == types_pb2.FINISH_REASON_STOP
    # the session continues from the cut choice: the next prompt extends it with no prefix violation
    follow = {"token_ids": PROMPT + tokens[:end] + [9], "sampling_params": {"max_tokens": 2}}
    assert (await client.post("/inference/v1/generate", json=follow, headers=session)).status_code == 200
    calls = [c for c in recorder.calls if c.session_id == "renderers-1"]
    assert len(calls) == 2 and all(c.episode_broken == "" for c in calls), calls
    assert calls[0].choices[0].token_ids == tuple(tokens[:end])


async def test_bad_stop_token_ids_are_refused(gw) -> None:
    _, client, _ = gw
    cases = {
        "negative": [-1],
        "too many": list(range(MAX_STOP_TOKEN_IDS + 1)),
        "not an int32": [2**31],
    }
    for name, ids in cases.items():
        refused = await client.post("/inference/v1/generate", json=body(stop_token_ids=ids))
        assert refused.status_code == 400, (name, refused.text)
        assert refused.json()["error"]["param"] == "sampling_params.stop_token_ids", (name, refused.json())
    # vLLM's native /generate answers with text, which the gateway cannot cut: refused, not ignored
    native = {"prompt": {"prompt_token_ids": PROMPT}, "max_tokens": 3, "stop_token_ids": [0]}
    refused = await client.post("/generate", json=native)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "stop_token_ids"


async def test_cut_keeps_the_versions_before_the_stop_and_marks_a_last_token_stop() -> None:
    completion = types_pb2.Completion(
        completion_token_ids=[10, 11, 12, 13, 14],
        logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5],
        finish_reason=types_pb2.FINISH_REASON_LENGTH,
        version_spans=[
            types_pb2.WeightVersionSpan(version=5, start=0, end=2),
            types_pb2.WeightVersionSpan(version=6, start=2, end=5),
        ],
        text="some text",
    )
    cut = cut_at_stop_token(completion, frozenset({13, 11}))
    assert list(cut.completion_token_ids) == [10, 11]
    assert list(cut.logprobs) == pytest.approx([-0.1, -0.2])
    assert [(s.version, s.start, s.end) for s in cut.version_spans] == [(5, 0, 2)]
    assert cut.finish_reason == types_pb2.FINISH_REASON_STOP and cut.text == ""
    later = cut_at_stop_token(completion, frozenset({13}))
    assert [(s.version, s.start, s.end) for s in later.version_spans] == [(5, 0, 2), (6, 2, 4)]
    # the stop token as the last one: vLLM reports stop, not length
    last = cut_at_stop_token(completion, frozenset({14}))
    assert list(last.completion_token_ids) == [10, 11, 12, 13, 14]
    assert last.finish_reason == types_pb2.FINISH_REASON_STOP
    assert cut_at_stop_token(completion, frozenset({99})) is completion
