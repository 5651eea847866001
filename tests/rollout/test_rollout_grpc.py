"""RolloutService over gRPC on a real in-process server with the transformers engine (tiny model)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
import torch
from transports.support import Packed, WeightsServer, model_with_state, perturbed_state, reference_logprobs

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import open_channel
from services.common.cpus import LINGER_S, lender_idle
from services.common.serve import start_server
from services.rollout.config import RolloutSettings
from services.rollout.engine import Sampling
from services.rollout.server import RolloutApp
from services.rollout.validation import PromptInput

pytestmark = pytest.mark.asyncio(loop_scope="module")
TIMEOUT = 60.0


def settings_for(model_dir: Path, **overrides) -> RolloutSettings:
    base = dict(
        model=str(model_dir), engine="transformers", port=0, max_model_len=256, hf={"num_threads": 1},
        rollout_id="hf-test", max_in_flight=4,
    )  # fmt: skip
    return RolloutSettings.load(**{**base, **overrides})


class Running:
    def __init__(self, running, channel) -> None:
        self.running = running
        self.app: RolloutApp = running.app
        self.channel = channel
        self.stub = rollout_pb2_grpc.RolloutServiceStub(channel)

    async def generate(
        self, prompt: types_pb2.Prompt, request_id: str = "", **sampling
    ) -> list[types_pb2.Completion]:
        request = rollout_pb2.GenerateRequest(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            sampling_params=types_pb2.SamplingParams(**sampling),
        )
        return [c async for r in self.stub.Generate(request, timeout=TIMEOUT) for c in r.completions]

    async def score(self, prompt: list[int], completion: list[int], temperature: float):
        sequence = types_pb2.TokenSequence(
            prompt_token_ids=prompt, completion_token_ids=completion, temperature=temperature
        )
        return await self.stub.ScoreTokens(rollout_pb2.ScoreTokensRequest(sequence=sequence), timeout=TIMEOUT)

    async def state(self) -> rollout_pb2.GetRolloutStateResponse:
        return await self.stub.GetRolloutState(rollout_pb2.GetRolloutStateRequest(), timeout=TIMEOUT)


async def _start(settings: RolloutSettings) -> Running:
    running = await start_server(RolloutApp(settings), settings)
    return Running(running, open_channel(running.address))


async def _close(server: Running) -> None:
    await server.channel.close()
    await server.running.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def server(tiny_model_dir: Path):
    started = await _start(settings_for(tiny_model_dir))
    yield started
    await _close(started)


def _text_prompt(text: str = "12+34=") -> types_pb2.Prompt:
    return types_pb2.Prompt(id="p-" + text[:40], env_name="arithmetic", text=text)


async def test_generate_streams_n_completions_with_behaviour_logprobs(
    server: Running, reference_model
) -> None:
    completions = await server.generate(_text_prompt(), n=3, temperature=0.7, max_tokens=12, seed=7)
    assert sorted(c.index for c in completions) == [0, 1, 2]
    tokenizer = server.app.rollout._tokenizer
    expected_prompt = tokenizer("12+34=")["input_ids"]
    for c in completions:
        assert c.prompt_id == "p-12+34=" and c.rollout_id == "hf-test"
        assert list(c.prompt_token_ids) == expected_prompt
        assert 1 <= len(c.completion_token_ids) <= 12
        assert len(c.logprobs) == len(c.completion_token_ids)
        assert [(s.version, s.start, s.end) for s in c.version_spans] == [(0, 0, len(c.completion_token_ids))]
        assert c.finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)
        assert c.sampling_params.n == 3 and c.sampling_params.top_p == 1.0
        assert c.text == tokenizer.decode(c.completion_token_ids, skip_special_tokens=True)
        ref = reference_logprobs(reference_model, expected_prompt, list(c.completion_token_ids), 0.7)
        assert torch.allclose(torch.tensor(list(c.logprobs)), ref, atol=1e-4)
        scored = await server.score(expected_prompt, list(c.completion_token_ids), 0.7)
        assert scored.weight_version == 0
        assert torch.allclose(torch.tensor(list(scored.logprobs)), ref, atol=1e-4)
    state = await server.state()
    assert state.tokens_generated >= sum(len(c.completion_token_ids) for c in completions)


async def test_seeded_requests_are_reproducible(server: Running) -> None:
    first = await server.generate(_text_prompt("7*8="), n=2, temperature=1.0, max_tokens=8, seed=3)
    second = await server.generate(_text_prompt("7*8="), n=2, temperature=1.0, max_tokens=8, seed=3)
    key = lambda cs: sorted((c.index, tuple(c.completion_token_ids)) for c in cs)  # noqa: E731
    assert key(first) == key(second)


async def test_chat_prompt_goes_through_the_chat_template(server: Running) -> None:
    prompt = types_pb2.Prompt(
        id="chat", messages=[types_pb2.ChatMessage(role="user", content="What is 2+2?")]
    )
    completions = await server.generate(prompt, n=1, temperature=1.0, max_tokens=4)
    tokenizer = server.app.rollout._tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert list(completions[0].prompt_token_ids) == tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("prompt", "sampling", "needle"),
    [
        (
            types_pb2.Prompt(id="x"),
            dict(n=1, temperature=1.0, max_tokens=4),
            "exactly one of text / messages",
        ),
        (_text_prompt(), dict(n=0, temperature=1.0, max_tokens=4), "n must be in [1, 256]"),
        (_text_prompt(), dict(n=1, temperature=0.0, max_tokens=4), "temperature must be"),
        (_text_prompt(), dict(n=1, temperature=1.0, max_tokens=0), "max_tokens must be >= 1"),
        (_text_prompt("9" * 300), dict(n=1, temperature=1.0, max_tokens=4), "max_model_len"),
    ],
)
async def test_invalid_generate_requests(server: Running, prompt, sampling, needle: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await server.generate(prompt, **sampling)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in info.value.details()


async def test_invalid_score_requests(server: Running) -> None:
    for prompt, completion, temperature, needle in [
        ([1, 2], [], 1.0, "completion_token_ids is empty"),
        ([1, 2], [3], 0.0, "temperature must be in [0.01, 2]"),
        ([1, 2], [10**6], 1.0, "outside the vocabulary"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await server.score(prompt, completion, temperature)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in info.value.details()


async def test_max_in_flight_gives_resource_exhausted(server: Running) -> None:
    gate = threading.Event()
    # Hold the engine thread so admitted requests stay in flight (deterministic backpressure).
    held = server.app.rollout.engine._executor.submit(gate.wait)  # type: ignore[attr-defined]
    calls = []
    try:
        for i in range(4):
            call = server.generate(_text_prompt(), request_id=f"held-{i}", n=1, temperature=1.0, max_tokens=2)
            calls.append(asyncio.ensure_future(call))
        for _ in range(200):
            if (await server.state()).in_flight == 4:
                break
            await asyncio.sleep(0.05)
        assert (await server.state()).in_flight == 4
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await server.generate(_text_prompt(), n=1, temperature=1.0, max_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_in_flight 4" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await server.generate(_text_prompt(), request_id="held-0", n=1, temperature=1.0, max_tokens=2)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already in flight" in info.value.details()
    finally:
        gate.set()
        held.result(timeout=TIMEOUT)
    results = await asyncio.gather(*calls)
    assert all(len(r) == 1 for r in results)
    assert (await server.state()).in_flight == 0


def _batch_request(request_id: str, text: str = "12+34=", **sampling) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id=request_id, prompt=_text_prompt(text), sampling_params=types_pb2.SamplingParams(**sampling)
    )


async def _batch(server: Running, *requests: rollout_pb2.GenerateRequest) -> list:
    call = server.stub.GenerateBatch(rollout_pb2.GenerateBatchRequest(requests=requests), timeout=TIMEOUT)
    return [response async for response in call]


async def test_generate_batch_answers_each_request_and_fails_only_the_bad_one(
    server: Running, reference_model
) -> None:
    responses = await _batch(
        server,
        _batch_request("b-0", n=3, temperature=0.7, max_tokens=6, seed=1),
        _batch_request("b-bad", n=1, temperature=0.0, max_tokens=4),
        _batch_request("b-1", "7+8=", n=2, temperature=1.0, max_tokens=4, seed=2),
    )
    completions: dict[str, list[types_pb2.Completion]] = {}
    errors = {}
    for response in responses:
        assert response.results, "an empty stream message"
        for result in response.results:
            if result.HasField("error"):
                assert not result.completions and result.request_id not in errors
                errors[result.request_id] = result.error
            else:
                completions.setdefault(result.request_id, []).extend(result.completions)
    assert sorted(errors) == ["b-bad"]
    assert errors["b-bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature must be" in errors["b-bad"].message
    assert sorted(c.index for c in completions["b-0"]) == [0, 1, 2]
    assert sorted(c.index for c in completions["b-1"]) == [0, 1]
    tokenizer = server.app.rollout._tokenizer
    for request_id, text, temperature in [("b-0", "12+34=", 0.7), ("b-1", "7+8=", 1.0)]:
        prompt_ids = tokenizer(text)["input_ids"]
        for c in completions[request_id]:  # the same Completion a Generate call would carry
            assert c.prompt_id == "p-" + text and c.rollout_id == "hf-test"
            assert list(c.prompt_token_ids) == prompt_ids
            assert [(s.version, s.start, s.end) for s in c.version_spans] == [(0, 0, len(c.logprobs))]
            ref = reference_logprobs(reference_model, prompt_ids, list(c.completion_token_ids), temperature)
            assert torch.allclose(torch.tensor(list(c.logprobs)), ref, atol=1e-4)
    assert (await server.state()).in_flight == 0


async def test_generate_batch_refuses_a_batch_it_cannot_take(server: Running) -> None:
    sampling = dict(n=1, temperature=1.0, max_tokens=2)
    for requests, code, needle in [
        ((), grpc.StatusCode.INVALID_ARGUMENT, "the batch has no requests"),
        (
            [_batch_request("twice", **sampling), _batch_request("twice", **sampling)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "request_id 'twice' appears twice",
        ),
        (
            [_batch_request(f"r-{i}", **sampling) for i in range(5)],
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "a batch of 5 requests is more than rollout hf-test takes at once (max_in_flight 4)",
        ),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _batch(server, *requests)
        assert info.value.code() == code
        assert needle in info.value.details()


async def test_cancelling_a_generate_batch_cancels_its_requests(server: Running) -> None:
    gate = threading.Event()
    held = server.app.rollout.engine._executor.submit(gate.wait)  # type: ignore[attr-defined]
    request = rollout_pb2.GenerateBatchRequest(
        requests=[_batch_request(f"c-{i}", n=1, temperature=1.0, max_tokens=2) for i in range(2)]
    )
    call = server.stub.GenerateBatch(request, timeout=TIMEOUT)
    reading = asyncio.ensure_future(call.read())
    try:
        for _ in range(200):
            if (await server.state()).in_flight == 2:
                break
            await asyncio.sleep(0.05)
        assert (await server.state()).in_flight == 2
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        for _ in range(200):
            if (await server.state()).in_flight == 0:
                break
            await asyncio.sleep(0.05)
        assert (await server.state()).in_flight == 0  # cancelled while the engine was still held
    finally:
        gate.set()
        held.result(timeout=TIMEOUT)


async def test_state_reports_engine_and_limits(server: Running, tiny_model_dir: Path) -> None:
    state = await server.state()
    assert state.rollout_id == "hf-test" and state.engine == "transformers"
    assert state.model == str(tiny_model_dir)
    assert state.status == rollout_pb2.ROLLOUT_STATUS_READY
    assert state.max_in_flight == 4 and state.staged_version == -1


async def test_weight_updates_over_grpc_stream_and_shared_memory(
    tiny_model_dir: Path, reference_model
) -> None:
    server = await _start(settings_for(tiny_model_dir, rollout_id="hf-update"))
    prompt = _text_prompt("5+6=")
    try:
        async with WeightsServer() as learner:
            # v1 over grpc_stream
            state1 = perturbed_state(reference_model, seed=1)
            wv1 = learner.publish(1, Packed(state1))
            staged = await server.stub.StageWeights(
                rollout_pb2.StageWeightsRequest(weight_version=wv1), timeout=TIMEOUT
            )
            assert staged.version == 1 and staged.bytes == staged.received_bytes == wv1.total_bytes
            assert (await server.state()).staged_version == 1
            committed = await server.stub.CommitWeights(
                rollout_pb2.CommitWeightsRequest(version=1), timeout=TIMEOUT
            )
            assert committed.version == 1
            state = await server.state()
            assert (state.weight_version, state.staged_version) == (1, -1)
            await _check_policy(server, prompt, model_with_state(reference_model, state1), version=1)

            # v2 over shared memory
            state2 = perturbed_state(reference_model, seed=2)
            packed2 = Packed(state2)
            name = f"grpo_{uuid.uuid4().hex[:8]}_v2"
            segment = packed2.to_segment(name)
            try:
                wv2 = packed2.weight_version(2)
                wv2.shared_memory.segment_name = name
                wv2.shared_memory.size = len(packed2.data)
                await server.stub.StageWeights(
                    rollout_pb2.StageWeightsRequest(weight_version=wv2), timeout=TIMEOUT
                )
                await server.stub.CommitWeights(rollout_pb2.CommitWeightsRequest(version=2), timeout=TIMEOUT)
            finally:
                segment.close()
                segment.unlink()
            await _check_policy(server, prompt, model_with_state(reference_model, state2), version=2)
            again = await server.stub.CommitWeights(
                rollout_pb2.CommitWeightsRequest(version=2), timeout=TIMEOUT
            )
            assert again.version == 2  # idempotent retry

            await _check_sync_errors(server, learner, state1)
    finally:
        await _close(server)


async def _check_policy(server: Running, prompt: types_pb2.Prompt, model, version: int) -> None:
    completions = await server.generate(prompt, n=2, temperature=0.8, max_tokens=10)
    for c in completions:
        assert [(s.version, s.start, s.end) for s in c.version_spans] == [
            (version, 0, len(c.completion_token_ids))
        ]
        ids = list(c.prompt_token_ids), list(c.completion_token_ids)
        ref = reference_logprobs(model, *ids, 0.8)
        assert torch.allclose(torch.tensor(list(c.logprobs)), ref, atol=1e-4)
        scored = await server.score(*ids, 1.3)
        assert scored.weight_version == version
        assert torch.allclose(
            torch.tensor(list(scored.logprobs)), reference_logprobs(model, *ids, 1.3), atol=1e-4
        )


async def _check_sync_errors(server: Running, learner: WeightsServer, state) -> None:
    async def stage(wv):
        return await server.stub.StageWeights(
            rollout_pb2.StageWeightsRequest(weight_version=wv), timeout=TIMEOUT
        )

    cases = [
        (learner.publish(1, Packed(state)), grpc.StatusCode.ABORTED, "not newer"),
        (learner.publish(3, Packed(state), corrupt=True), grpc.StatusCode.DATA_LOSS, "checksum mismatch"),
    ]
    ipc = Packed(state).weight_version(4)
    ipc.cuda_ipc.SetInParent()  # no exported buffer described
    cases.append((ipc, grpc.StatusCode.INVALID_ARGUMENT, "must describe exactly one exported buffer"))
    nccl = Packed(state).weight_version(4)
    nccl.nccl.master_address = "127.0.0.1"  # no port, group or backend
    cases.append(
        (nccl, grpc.StatusCode.INVALID_ARGUMENT, "weight_version.nccl needs master_address and master_port")
    )
    nccl = Packed(state).weight_version(4)
    nccl.nccl.master_address, nccl.nccl.master_port, nccl.nccl.world_size = "127.0.0.1", 1, 2
    nccl.nccl.group_id, nccl.nccl.backend, nccl.nccl.deadline_seconds = "g", "gloo", 1.0
    nccl.nccl.broadcast_id = "b"
    nccl.nccl.ranks["someone-else"] = 1
    cases.append((nccl, grpc.StatusCode.FAILED_PRECONDITION, "is not a member of weight-sync group g"))
    for wv, code, needle in cases:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stage(wv)
        assert info.value.code() == code and needle in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await server.stub.CommitWeights(rollout_pb2.CommitWeightsRequest(version=5), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "not staged" in info.value.details()
    bogus = {**state, "bogus.weight": torch.zeros(3)}
    await stage(learner.publish(7, Packed(bogus)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await server.stub.CommitWeights(rollout_pb2.CommitWeightsRequest(version=7), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "unexpected ['bogus.weight']" in info.value.details()
    state_now = await server.state()
    assert (state_now.weight_version, state_now.staged_version) == (2, 7)  # kept for a retry
    await server.stub.AbortWeights(rollout_pb2.AbortWeightsRequest(version=7), timeout=TIMEOUT)
    await stage(learner.publish(6, Packed(state)))
    assert (await server.state()).staged_version == 6
    await server.stub.AbortWeights(rollout_pb2.AbortWeightsRequest(version=6), timeout=TIMEOUT)
    state_now = await server.state()
    assert (state_now.staged_version, state_now.weight_version) == (-1, 2)


async def test_the_busy_file_reads_busy_exactly_while_the_rollout_works(
    tiny_model_dir: Path, tmp_path, reference_model
) -> None:
    """Busy while requests are in flight, and while it scores, stages or commits weights (the learner
    trains while the rollouts sync: it must not borrow their cores then); idle otherwise."""
    busy_file = tmp_path / "rollout-0.busy"
    started = await _start(settings_for(tiny_model_dir, busy_file=busy_file))
    rollout = started.app.rollout
    seen: dict[str, bool] = {}

    def watched(name: str, call):
        async def run(*args, **kwargs):
            seen[name] = not lender_idle(busy_file)
            return await call(*args, **kwargs)

        return run

    rollout.engine.score_tokens = watched("score", rollout.engine.score_tokens)
    rollout.engine.load_weights = watched("commit", rollout.engine.load_weights)
    rollout._stager.stage = watched("stage", rollout._stager.stage)

    async def idle_after_linger() -> bool:  # a lender stays busy LINGER_S after its last work
        await asyncio.sleep(LINGER_S * 3)
        return lender_idle(busy_file)

    try:
        assert lender_idle(busy_file)
        async with WeightsServer() as learner:
            wv = learner.publish(1, Packed(perturbed_state(reference_model, seed=1)))
            await started.stub.StageWeights(
                rollout_pb2.StageWeightsRequest(weight_version=wv), timeout=TIMEOUT
            )
            assert not lender_idle(busy_file)  # lingers into the commit's round trip
            await started.stub.CommitWeights(rollout_pb2.CommitWeightsRequest(version=1), timeout=TIMEOUT)
            assert await idle_after_linger()
        await started.score([1, 2, 3], [4, 5], 1.0)
        assert seen == {"stage": True, "commit": True, "score": True} and await idle_after_linger()
        stream = started.app.rollout.generate(
            "r1", PromptInput("p", text="12+34="), Sampling(n=2, max_tokens=4)
        )
        first = await anext(stream)  # both samples of the one batch: suspended, still in flight
        assert len(first.completions) == 2
        await asyncio.sleep(LINGER_S * 3)
        assert not lender_idle(busy_file)
        assert [g async for g in stream] == []
        assert await idle_after_linger()
        await started.generate(_text_prompt(), n=2, max_tokens=4, temperature=1.0)  # over gRPC too
        assert await idle_after_linger()
    finally:
        await _close(started)
