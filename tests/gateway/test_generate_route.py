"""vLLM's native `POST /generate` against real rollouts (tiny model), driven by atropos' own client
(`atroposlib`'s `VLLMServer`, and its `ManagedServer` building multi-turn sequences the way atropos
envs do): what it parses is what the registry holds, and its sequences match (matching.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from atroposlib.envs.server_handling.managed_server import ManagedServer
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.vllm_server import VLLMServer

from gateway.support import ListRecorder, gateway
from grpo.common.v1 import types_pb2
from services.gateway.matching import Refused, match_sequence
from services.gateway.registry import GenerationRegistry

pytestmark = pytest.mark.asyncio(loop_scope="package")

M = -100
MODEL, ENV = types_pb2.TURN_SOURCE_MODEL, types_pb2.TURN_SOURCE_ENV
FINISH = {"stop": types_pb2.FINISH_REASON_STOP, "length": types_pb2.FINISH_REASON_LENGTH}


@pytest_asyncio.fixture(scope="module", loop_scope="package")
async def gw(rollouts):
    recorder = ListRecorder()
    async with gateway([r.address for r in rollouts], recorder=recorder) as (running, client):
        yield running, client, recorder


@contextlib.asynccontextmanager
async def vllm_server(url: str, model_dir: Path) -> AsyncIterator[VLLMServer]:
    """atropos' vLLM client as an env configures it (`--openai.base_url <gateway>/v1`), its health
    poll (`GET <root>/health`) running; the poll is stopped after."""
    config = APIServerConfig(
        model_name="grpo-mesh", base_url=f"{url}/v1", api_key="x", timeout=60,
        tokenizer_name=str(model_dir), server_type="vllm",
    )  # fmt: skip
    server = VLLMServer(config)
    try:
        yield server
    finally:
        if server.check_task is not None:
            server.check_task.cancel()
            with contextlib.suppress(BaseException):
                await server.check_task


def registry_of(running) -> GenerationRegistry:
    return running.app.gateway.registry


async def test_vllm_client_parses_what_the_registry_holds(gw, tiny_model_dir: Path) -> None:
    running, client, _ = gw
    before = registry_of(running).size
    async with vllm_server(running.url, tiny_model_dir) as server:
        prompt, outputs, logprobs, finishes = await server.tokens_and_logprobs_completion(
            prompt="The capital of France is", n=3, max_tokens=8, temperature=1.0, top_p=1.0, seed=5,
            stop=["User:"], top_k=-1,  # a vLLM field the gateway does not know: ignored
        )  # fmt: skip
        assert server.server_healthy
    assert prompt == server.tokenizer.encode("The capital of France is")
    assert len(outputs) == len(logprobs) == len(finishes) == 3
    registry = registry_of(running)
    assert registry.size >= before + 1
    for i, (ids, lps, finish) in enumerate(zip(outputs, logprobs, finishes, strict=True)):
        assert 1 <= len(ids) <= 8 and finish in FINISH
        held = registry.get(prompt + ids, len(prompt), len(prompt) + len(ids))
        assert held is not None, f"choice {i} is not in the registry"
        assert held.token_ids == tuple(ids)
        assert held.logprobs == tuple(lps)  # float32 values through JSON, exactly
        assert held.finish_reason == FINISH[finish]
        assert held.version_spans == ((0, 0, len(ids)),)
        matched = match_sequence(registry, prompt + ids, [M] * len(prompt) + ids, i)
        assert matched.prompt_token_ids == prompt
        assert list(matched.completion.completion_token_ids) == ids
        assert list(matched.completion.logprobs) == lps
    metrics = (await client.get("/metrics")).json()
    assert metrics["gateway/registry_size"] == registry.size and metrics["gateway/registry_evicted"] == 0
    assert (await client.get(f"{running.url}/health")).status_code == 200  # where atropos polls


async def test_managed_server_sequences_match(gw, tiny_model_dir: Path) -> None:
    """A two-turn atropos episode through `ManagedServer.chat_completion` (its chat template rendered by
    atropos, the first turn n=2): the nodes it keeps are what an env submits (`node.tokens`,
    `node.masked_tokens`, the first turn kept unmasked in the extended node)."""
    running, _, _ = gw
    registry = registry_of(running)
    user = [{"role": "user", "content": "What is 1+1?"}]
    async with vllm_server(running.url, tiny_model_dir) as server:
        managed = ManagedServer(server, tokenizer=server.tokenizer)
        first = await managed.chat_completion(messages=user, n=2, max_tokens=6, temperature=1.0)
        reply = {"role": "assistant", "content": first.choices[0].message.content}
        await managed.chat_completion(
            messages=[*user, reply, {"role": "user", "content": "And 2+2?"}], n=1, max_tokens=6,
            temperature=1.0,
        )  # fmt: skip
        nodes = managed.get_state()["nodes"]
    assert len(nodes) == 2  # the episode (the first choice, extended in place) and the other choice
    episode, other = nodes
    unmasked = [i for i, m in enumerate(episode.masked_tokens) if m != M]
    matched = match_sequence(registry, episode.tokens, episode.masked_tokens, 0)
    start = unmasked[0]
    assert matched.prompt_token_ids == episode.tokens[:start]
    completion = matched.completion
    assert list(completion.completion_token_ids) == episode.tokens[start:]
    assert [t.source for t in completion.turns] == [MODEL, ENV, MODEL]
    assert len(matched.generations) == 2
    for position, logprob in zip(range(start, len(episode.tokens)), completion.logprobs, strict=True):
        assert logprob == (episode.logprobs[position] if position in unmasked else 0.0)
    assert match_sequence(registry, other.tokens, other.masked_tokens, 1).completion.turns == []
    assert registry.claim(matched.generations) == []
    # a token the model did not sample: refused, naming where
    forged = list(episode.tokens)
    forged[unmasked[-1]] = (forged[unmasked[-1]] + 1) % server.tokenizer.vocab_size
    mask = [t if m != M else M for t, m in zip(forged, episode.masked_tokens, strict=True)]
    with pytest.raises(Refused, match="of sequence 0 were not generated by this gateway"):
        match_sequence(registry, forged, mask, 0)


async def test_generate_route_shape_sessions_and_refusals(gw) -> None:
    running, client, recorder = gw
    body = {"prompt": {"prompt_token_ids": [3, 4, 5]}, "logprobs": 0, "n": 2, "max_tokens": 4}
    answer = await client.post("/generate", json=body, headers={"X-Session-ID": "atropos-1"})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["prompt_token_ids"] == [3, 4, 5] and data["prompt"] is None
    assert len(data["text"]) == len(data["token_ids"]) == len(data["finish_reasons"]) == 2
    for ids, per_token, spans in zip(
        data["token_ids"], data["logprobs"], data["weight_versions"], strict=True
    ):
        assert [int(next(iter(entry[0]))) for entry in per_token] == ids
        assert spans == [{"version": 0, "start": 0, "end": len(ids)}]
        assert registry_of(running).get([3, 4, 5, *ids], 3, 3 + len(ids)) is not None
    call = recorder.calls[-1]
    assert (call.session_id, call.route, call.prompt_token_ids) == ("atropos-1", "generate", (3, 4, 5))
    text = await client.post("/generate", json={"prompt": "Hello", "max_tokens": 3})
    assert text.status_code == 200 and len(text.json()["prompt_token_ids"]) >= 1
    refusals = {
        "prompt_logprobs": {**body, "prompt_logprobs": 1},
        "logprobs": {**body, "logprobs": 2},
        "stream": {**body, "stream": True},
        "prompt.prompt_token_ids": {**body, "prompt": {"prompt_token_ids": []}},
        "temperature": {**body, "temperature": 0.0},
        "prompt": {"max_tokens": 4},
    }
    for param, bad in refusals.items():
        refused = await client.post("/generate", json=bad)
        assert refused.status_code == 400, (param, refused.text)
        assert refused.json()["error"]["param"] == param, refused.json()
    assert (
        "prompt logprobs are not served"
        in (await client.post("/generate", json=refusals["prompt_logprobs"])).json()["error"]["message"]
    )


async def test_every_route_registers_its_generations(gw) -> None:
    running, client, _ = gw
    registry = registry_of(running)
    chat = await client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "return_token_ids": True},
    )
    completions = await client.post(
        "/v1/completions", json={"prompt": [7, 8, 9], "max_tokens": 3, "return_token_ids": True}
    )
    tokens = await client.post(
        "/inference/v1/generate", json={"token_ids": [7, 8], "sampling_params": {"max_tokens": 3}}
    )
    for answer in (chat, completions):
        body = answer.json()
        prompt, ids = body["prompt_token_ids"], body["choices"][0]["token_ids"]
        assert registry.get(prompt + ids, len(prompt), len(prompt) + len(ids)) is not None
    ids = tokens.json()["choices"][0]["token_ids"]
    assert registry.get([7, 8, *ids], 2, 2 + len(ids)) is not None
    assert httpx.codes.is_success(tokens.status_code)


async def test_registry_settings_bound_the_gateways_registry(rollouts) -> None:
    """`--registry.max-generations` reaches the registry the gateway builds: one held, the rest evicted."""
    async with gateway([r.address for r in rollouts], registry={"max_generations": 1}) as (_, client):
        for prompt in ([3, 4], [5, 6]):
            body = {"prompt": {"prompt_token_ids": prompt}, "logprobs": 0, "max_tokens": 2}
            assert (await client.post("/generate", json=body)).status_code == 200
        metrics = (await client.get("/metrics")).json()
    assert metrics["gateway/registry_size"] == 1 and metrics["gateway/registry_evicted"] == 1
