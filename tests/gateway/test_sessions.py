"""Sessions over real rollouts: sticky routing across two rollouts, the prefix rule, 429 backpressure,
bearer-token auth (the pure session table and recorder: test_logic.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from gateway.support import ListRecorder, gateway
from services.gateway.admission import InFlightAdmission

pytestmark = pytest.mark.asyncio(loop_scope="package")

LONG = {"n": 4, "max_tokens": 240, "temperature": 1.0}  # keeps a request in flight for a while


def _generate(token_ids: list[int], **sampling) -> dict:
    return {"token_ids": token_ids, "sampling_params": {"max_tokens": 4, **sampling}}


async def _until(condition, what: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def test_sessions_stick_to_their_rollout(rollouts) -> None:
    recorder = ListRecorder()
    addresses = [r.address for r in rollouts]
    async with gateway(addresses, recorder, admission={"per_rollout_in_flight": 1}) as (running, client):
        first = running.app.pool.views[addresses[0]]
        slow = asyncio.create_task(
            client.post(
                "/inference/v1/generate", json=_generate([5, 6, 7], **LONG), headers={"X-Session-ID": "a"}
            )
        )
        await _until(lambda: first.in_flight == 1, "session a in flight on the first rollout")
        # the first rollout is at its bound: a new session goes to the other one
        reply = await client.post(
            "/inference/v1/generate", json=_generate([5]), headers={"X-Session-ID": "b"}
        )
        assert reply.status_code == 200, reply.text
        assert (await slow).status_code == 200
        # both idle now (least loaded would pick the first rollout for both): each session keeps its own
        for session in ("b", "a", "b", "a"):
            reply = await client.post(
                "/inference/v1/generate", json=_generate([9]), headers={"X-Session-ID": session}
            )
            assert reply.status_code == 200, reply.text
    by_session: dict[str, set[str]] = {}
    for call in recorder.calls:
        by_session.setdefault(call.session_id, set()).add(call.rollout_id)
    assert by_session == {"a": {"r0"}, "b": {"r1"}}


async def test_prefix_violation_is_counted_and_breaks_the_episode(rollouts) -> None:
    recorder = ListRecorder()
    async with gateway([rollouts[0].address], recorder) as (_, client):
        headers = {"X-Session-ID": "episode-1"}
        first = (
            await client.post("/inference/v1/generate", json=_generate([5, 6, 7], n=2), headers=headers)
        ).json()
        extended = [5, 6, 7, *first["choices"][1]["token_ids"], 9, 9]
        await client.post("/inference/v1/generate", json=_generate(extended), headers=headers)
        metrics = (await client.get("/metrics")).json()
        assert metrics["episode/prefix_violations"] == 0
        assert [c.episode_broken for c in recorder.calls] == ["", ""]

        await client.post("/inference/v1/generate", json=_generate([5, 6, 8]), headers=headers)
        metrics = (await client.get("/metrics")).json()
        assert metrics["episode/prefix_violations"] == 1
        assert "prefix violation at call 3" in recorder.calls[-1].episode_broken
        # another session is not affected; the broken one stays broken
        await client.post("/inference/v1/generate", json=_generate([5]), headers={"X-Session-ID": "other"})
        assert recorder.calls[-1].episode_broken == ""
    call = recorder.calls[0]
    assert call.prompt_token_ids == (5, 6, 7) and call.route == "generate" and len(call.choices) == 2
    choice = call.choices[1]
    assert list(choice.token_ids) == first["choices"][1]["token_ids"]
    assert [lp["logprob"] for lp in first["choices"][1]["logprobs"]["content"]] == list(choice.logprobs)
    assert choice.version_spans == ((0, 0, len(choice.token_ids)),)


async def test_full_gateway_answers_429_with_retry_after(rollouts) -> None:
    async with gateway([rollouts[0].address], admission={"per_rollout_in_flight": 1, "retry_after_s": 3}) as (
        running,
        client,
    ):
        view = running.app.pool.views[rollouts[0].address]
        slow = asyncio.create_task(client.post("/inference/v1/generate", json=_generate([5, 6], **LONG)))
        await _until(lambda: view.in_flight == 1, "the first request in flight")
        refused = await client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 2})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "3"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert (await slow).status_code == 200
        assert (
            await client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 2})
        ).status_code == 200
        assert (await client.get("/metrics")).json()["gateway/rejected_full"] == 1


async def test_a_session_whose_rollout_is_full_gets_429(rollouts) -> None:
    """The gateway-wide admission has room (1 of 2), the session's rollout has none: 429, not a move."""
    addresses = [r.address for r in rollouts]
    async with gateway(addresses, admission={"per_rollout_in_flight": 1}) as (running, client):
        first = running.app.pool.views[addresses[0]]
        headers = {"X-Session-ID": "busy"}
        slow = asyncio.create_task(
            client.post("/inference/v1/generate", json=_generate([5], **LONG), headers=headers)
        )
        await _until(lambda: first.in_flight == 1, "the session's first call in flight")
        refused = await client.post("/inference/v1/generate", json=_generate([5]), headers=headers)
        assert refused.status_code == 429 and "session's rollout" in refused.json()["error"]["message"]
        assert (
            await client.post("/inference/v1/generate", json=_generate([5]))
        ).status_code == 200  # other one
        assert (await slow).status_code == 200


async def test_injected_admission_refusal_is_429(rollouts) -> None:
    full = InFlightAdmission(max_in_flight=0, retry_after_s=7)
    async with gateway([rollouts[0].address], admission_impl=full) as (_, client):
        refused = await client.post("/inference/v1/generate", json=_generate([5]))
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "7"
        assert full.in_flight == 0


async def test_bearer_token_guards_every_route_but_health(rollouts, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    async with gateway([rollouts[0].address], security={"token_file": token_file}) as (_, client):
        body = _generate([5])
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            reply = await client.post("/inference/v1/generate", json=body, headers=headers)
            assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
        two = [("Authorization", "Bearer s3cret"), ("Authorization", "Bearer s3cret")]
        assert (await client.post("/inference/v1/generate", json=body, headers=two)).status_code == 401
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/health")).status_code == 200
        good = {"Authorization": "Bearer s3cret"}
        assert (await client.post("/inference/v1/generate", json=body, headers=good)).status_code == 200
        assert (await client.get("/v1/models", headers=good)).status_code == 200


async def test_health_is_503_without_a_ready_rollout() -> None:
    async with gateway(["127.0.0.1:1"], timeouts={"health_s": 0.5}) as (_, client):
        assert (await client.get("/health")).status_code == 503
        reply = await client.post("/inference/v1/generate", json=_generate([5]))
        assert reply.status_code == 503 and "Retry-After" in reply.headers


async def test_chat_turns_of_a_session_are_bridged_token_exact(rollouts) -> None:
    """Turn 2 sends turn 1's messages + the assistant's answer + a new user message: its prompt is turn
    1's prompt + the sampled tokens + the bridge, so no violation, whatever the model sampled."""
    recorder = ListRecorder()
    async with gateway([rollouts[0].address], recorder) as (_, client):
        headers = {"X-Session-ID": "chat-episode"}
        conversation = [{"role": "user", "content": "What is 2+2?"}]
        expected: list[int] = []  # the previous turn's prompt + the chosen choice's sampled tokens
        for turn in range(3):
            body = {
                "messages": conversation,
                "max_tokens": 6,
                "seed": 11 + turn,
                "n": 2,
                "return_token_ids": True,
            }
            reply = (await client.post("/v1/chat/completions", json=body, headers=headers)).json()
            assert reply["prompt_token_ids"][: len(expected)] == expected
            choice = reply["choices"][1]
            expected = reply["prompt_token_ids"] + choice["token_ids"]
            conversation += [choice["message"], {"role": "user", "content": f"and then {turn}?"}]
        assert (await client.get("/metrics")).json()["episode/prefix_violations"] == 0
    assert [c.episode_broken for c in recorder.calls] == ["", "", ""]
