"""The scheduler's gRPC clients against real servers on 127.0.0.1:0: request building, deadlines, and
status codes turned into domain errors by the one client-side table."""

from __future__ import annotations

import asyncio
import socket
from functools import partial

import grpc
import pytest
from prometheus_client import REGISTRY

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import grpc_options
from services.common.config import CONTROL_MESSAGE_BYTES
from services.common.errors import Cancelled, DeadlineExceeded, InvalidArgument, RemoteError, Unavailable
from services.scheduler.peers.clients import Batch, Sampling, ScoredGroup
from services.scheduler.peers.config import GenerateBatchSettings, TimeoutSettings
from services.scheduler.peers.grpc_clients import GrpcLearnerClient, GrpcRolloutClient
from services.transports import TransportKind

GROUPS = "grpo_scheduler_generate_batch_groups"  # the Prometheus histogram of groups per call
TIMEOUTS = TimeoutSettings(control=2, generate=2, weight_sync=2, train_step=2, score=2, connect=2)


def _completions(request: rollout_pb2.GenerateRequest) -> list[types_pb2.Completion]:
    return [
        types_pb2.Completion(prompt_id=request.prompt.id, index=i, sampling_params=request.sampling_params)
        for i in range(request.sampling_params.n)
    ]


class _Rollout(rollout_pb2_grpc.RolloutServiceServicer):
    """GenerateBatch by prompt id: "bad" fails its request, "crash" the whole call, "hang" holds the call
    until it is cancelled; the others get their first completion alone, then the rest."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []  # the request ids of each call
        self.hanging = asyncio.Event()  # a "hang" request is being held
        self.cancelled = asyncio.Event()

    async def GenerateBatch(self, request, context):
        self.batches.append([r.request_id for r in request.requests])
        for r in request.requests:
            result = partial(rollout_pb2.GenerateResult, request_id=r.request_id)
            if r.prompt.id == "bad":
                error = rollout_pb2.RequestError(code=3, message="prompt.text is empty")
                yield rollout_pb2.GenerateBatchResponse(results=[result(error=error)])
            elif r.prompt.id == "crash":
                raise RuntimeError("boom")  # unhandled: INTERNAL... or UNKNOWN
            elif r.prompt.id == "hang":
                self.hanging.set()
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    self.cancelled.set()
                    raise
            else:
                completions = _completions(r)
                yield rollout_pb2.GenerateBatchResponse(results=[result(completions=completions[:1])])
                yield rollout_pb2.GenerateBatchResponse(results=[result(completions=completions[1:])])

    async def GetRolloutState(self, request, context):
        return rollout_pb2.GetRolloutStateResponse(
            rollout_id="r-1", weight_version=7, status=rollout_pb2.ROLLOUT_STATUS_UPDATING, max_in_flight=5
        )

    async def StageWeights(self, request, context):
        """Version 1: whole; 2: a delta of 10 bytes; 3: unchanged (0 bytes); 4: a rollout from before
        received_bytes (unset)."""
        received = {1: 100, 2: 10, 3: 0}.get(request.weight_version.version)
        response = rollout_pb2.StageWeightsResponse(version=request.weight_version.version, bytes=100)
        if received is not None:
            response.received_bytes = received
        return response

    async def ScoreTokens(self, request, context):
        await asyncio.sleep(0.5)  # a rollout scoring at 200..400 tokens/s
        return rollout_pb2.ScoreTokensResponse(logprobs=[-1.0] * len(request.sequence.completion_token_ids))


class _Learner(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self) -> None:
        self.requests: list = []

    async def TrainStep(self, request, context):
        self.requests.append(request)
        return learner_pb2.TrainStepResponse(
            result=types_pb2.StepResult(step=1, weight_version=1, metrics={"loss": 0.25})
        )

    async def PrepareWeights(self, request, context):
        self.requests.append(request)
        return learner_pb2.PrepareWeightsResponse(
            weight_version=types_pb2.WeightVersion(version=4), prepare_ms=1.5
        )


@pytest.fixture
async def servers():
    server = grpc.aio.server(options=grpc_options(CONTROL_MESSAGE_BYTES))
    learner = _Learner()
    rollout = _Rollout()
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(rollout, server)
    learner_pb2_grpc.add_LearnerServiceServicer_to_server(learner, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield f"127.0.0.1:{port}", learner, rollout
    await server.stop(None)


async def test_rollout_client_speaks_domain_terms_and_maps_status_codes(servers) -> None:
    address, _, _ = servers
    client = GrpcRolloutClient(address, TIMEOUTS)
    try:
        info = await client.state()
        assert (info.rollout_id, info.weight_version, info.ready, info.max_in_flight) == ("r-1", 7, True, 5)
        sampling = Sampling(n=3, temperature=0.7, max_tokens=4, seed=9)
        completions = await client.generate("g1", types_pb2.Prompt(id="p"), sampling)
        assert [c.index for c in completions] == [0, 1, 2]
        assert completions[0].sampling_params.temperature == pytest.approx(0.7)
        with pytest.raises(
            InvalidArgument, match=f"rollout {address}: INVALID_ARGUMENT: prompt.text is empty"
        ) as bad:
            await client.generate("g2", types_pb2.Prompt(id="bad"), sampling)
        assert not bad.value.retryable and not bad.value.unreachable
        with pytest.raises(RemoteError) as crashed:
            await client.generate("g3", types_pb2.Prompt(id="crash"), sampling)
        assert not crashed.value.retryable
        with pytest.raises(RemoteError, match="UNIMPLEMENTED"):  # not served by this test server
            await client.commit(1)
    finally:
        await client.close()


async def test_a_stage_reports_the_bytes_that_crossed_an_unchanged_version_none(servers) -> None:
    address, _, _ = servers
    client = GrpcRolloutClient(address, TIMEOUTS)
    try:
        moved = [await client.stage(types_pb2.WeightVersion(version=v), deadline_s=5) for v in (1, 2, 3, 4)]
        assert moved == [100, 10, 0, 100]  # 0 is 0 (it once read as "whole"), unset counts the version
    finally:
        await client.close()


async def test_the_probe_deadline_grows_with_the_probe_tokens(servers) -> None:
    """A long (multi-turn) probe gets its tokens' share of time; a short one only the floor."""
    address, _, _ = servers
    timeouts = TIMEOUTS.model_copy(update={"probe": 0.2, "probe_tokens_per_s": 200.0})
    client = GrpcRolloutClient(address, timeouts)
    try:
        long = types_pb2.TokenSequence(prompt_token_ids=[1] * 380, completion_token_ids=[2] * 20)  # 2.2 s
        assert len((await client.score_tokens(long)).logprobs) == 20
        short = types_pb2.TokenSequence(prompt_token_ids=[1] * 8, completion_token_ids=[2] * 2)  # 0.25 s
        with pytest.raises(DeadlineExceeded):
            await client.score_tokens(short)
    finally:
        await client.close()


async def test_learner_client_builds_the_train_batch_and_the_transport_kind(servers) -> None:
    address, learner, _ = servers
    client = GrpcLearnerClient(address, TIMEOUTS)
    completion = types_pb2.Completion(prompt_id="p", index=0, completion_token_ids=[1, 2])
    group = ScoredGroup("p#0", types_pb2.Prompt(id="p"), [completion], [1.0], [types_pb2.RewardInfo(ok=True)])
    try:
        result = await client.train_step(Batch("step-0", 0, [group], [[0.5]]))
        assert (result.step, result.weight_version, result.metrics) == (1, 1, {"loss": 0.25})
        sent = learner.requests[-1].batch
        assert (sent.batch_id, sent.step, sent.groups[0].group_id) == ("step-0", 0, "p#0")
        assert list(sent.groups[0].advantages) == [0.5] and list(sent.groups[0].rewards) == [1.0]
        assert list(sent.groups[0].completions[0].completion_token_ids) == [1, 2]
        prepared = await client.prepare(TransportKind.shared_memory)
        assert (prepared.version, prepared.prepare_ms) == (4, 1.5)
        assert learner.requests[-1].transport == types_pb2.WEIGHT_TRANSPORT_KIND_SHARED_MEMORY
    finally:
        await client.close()


async def test_groups_issued_together_travel_in_one_call_and_fail_alone(servers) -> None:
    address, _, rollout = servers
    client = GrpcRolloutClient(address, TIMEOUTS, GenerateBatchSettings(window_ms=50, max_requests=3))
    sampling = Sampling(n=4, temperature=1.0, max_tokens=4)
    prompts = ["p0", "bad", "p2", "p3", "p4"]
    calls_before, groups_before = (
        REGISTRY.get_sample_value(f"{GROUPS}_{k}") or 0.0 for k in ("count", "sum")
    )
    try:
        results = await asyncio.gather(
            *(client.generate(f"g{i}", types_pb2.Prompt(id=p), sampling) for i, p in enumerate(prompts)),
            return_exceptions=True,
        )
        assert rollout.batches == [["g0", "g1", "g2"], ["g3", "g4"]]  # max_requests per call
        assert REGISTRY.get_sample_value(f"{GROUPS}_count") == calls_before + 2
        assert REGISTRY.get_sample_value(f"{GROUPS}_sum") == groups_before + 5
        assert isinstance(results[1], InvalidArgument) and not results[1].retryable
        assert str(results[1]) == f"rollout {address}: INVALID_ARGUMENT: prompt.text is empty"
        for i in (0, 2, 3, 4):
            assert [(c.prompt_id, c.index) for c in results[i]] == [(prompts[i], k) for k in range(4)]
        assert (client.batcher.calls, client.batcher.messages) == (2, 9)
        with pytest.raises(InvalidArgument, match="'g0' is already in flight"):
            await asyncio.gather(*(client.generate("g0", types_pb2.Prompt(id="p"), sampling) for _ in "ab"))
    finally:
        await client.close()


async def test_a_group_whose_caller_gives_up_is_not_sent_or_its_call_is_cancelled(servers) -> None:
    address, _, rollout = servers
    sampling = Sampling(n=2, temperature=1.0, max_tokens=4)
    waiting = GrpcRolloutClient(address, TIMEOUTS, GenerateBatchSettings(window_ms=60_000))
    immediate = GrpcRolloutClient(address, TIMEOUTS, GenerateBatchSettings(window_ms=0))
    try:
        unsent = asyncio.ensure_future(waiting.generate("u", types_pb2.Prompt(id="p"), sampling))
        await asyncio.sleep(0)  # the request waits for its window
        unsent.cancel()
        with pytest.raises(asyncio.CancelledError):
            await unsent
        assert not waiting.batcher._pending and not waiting.batcher._calls and rollout.batches == []

        hung = asyncio.ensure_future(immediate.generate("h", types_pb2.Prompt(id="hang"), sampling))
        await asyncio.wait_for(rollout.hanging.wait(), 2)
        assert rollout.batches == [["h"]]
        hung.cancel()
        await asyncio.wait_for(rollout.cancelled.wait(), 2)  # nobody waits for the call: cancelled
        with pytest.raises(asyncio.CancelledError):
            await hung

        closing = asyncio.ensure_future(immediate.generate("h2", types_pb2.Prompt(id="hang"), sampling))
        rollout.hanging.clear()
        await asyncio.wait_for(rollout.hanging.wait(), 2)
        await immediate.batcher.close()  # the client closes under a caller: a retryable domain error
        with pytest.raises(Cancelled) as closed:
            await closing
        assert closed.value.retryable
    finally:
        await waiting.close()
        await immediate.close()


async def test_a_dead_peer_is_unreachable_and_retryable() -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    client = GrpcRolloutClient(address, TIMEOUTS)
    try:
        with pytest.raises((Unavailable, DeadlineExceeded)) as dead:
            await client.state()
        assert dead.value.unreachable and dead.value.retryable
        with pytest.raises(DeadlineExceeded, match=r"not reachable within 0\.2s"):
            await client.wait_ready(0.2)
    finally:
        await client.close()
