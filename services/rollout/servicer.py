"""RolloutService gRPC handlers: translate protos <-> domain objects and call `Rollout`. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, Sampling
from services.rollout.rollout import Generated, Rollout, Status
from services.rollout.validation import PromptInput
from services.transports import registry as transports

_FINISH = {
    FINISH_STOP: types_pb2.FINISH_REASON_STOP,
    FINISH_LENGTH: types_pb2.FINISH_REASON_LENGTH,
    FINISH_ABORT: types_pb2.FINISH_REASON_ABORT,
}
_STATUS = {
    Status.LOADING: rollout_pb2.ROLLOUT_STATUS_LOADING,
    Status.READY: rollout_pb2.ROLLOUT_STATUS_READY,
    Status.UPDATING: rollout_pb2.ROLLOUT_STATUS_UPDATING,
    Status.DRAINING: rollout_pb2.ROLLOUT_STATUS_DRAINING,
}


def prompt_from_proto(message: types_pb2.Prompt) -> PromptInput:
    return PromptInput(
        prompt_id=message.id,
        text=message.text,
        messages=tuple((m.role, m.content) for m in message.messages),
    )


def sampling_from_proto(message: types_pb2.SamplingParams) -> Sampling:
    return Sampling(
        n=message.n,
        temperature=message.temperature,
        top_p=message.top_p,
        top_k=message.top_k,
        max_tokens=message.max_tokens,
        seed=message.seed,
        stop=tuple(message.stop),
    )


def sampling_to_proto(sampling: Sampling) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
        stop=list(sampling.stop),
    )


def completion_to_proto(generated: Generated, rollout_id: str) -> types_pb2.Completion:
    completion = generated.completion
    return types_pb2.Completion(
        prompt_id=generated.prompt_id,
        index=completion.index,
        prompt_token_ids=list(generated.prompt_token_ids),
        completion_token_ids=list(completion.token_ids),
        logprobs=list(completion.logprobs),
        finish_reason=_FINISH.get(completion.finish_reason, types_pb2.FINISH_REASON_UNSPECIFIED),
        version_spans=[
            types_pb2.WeightVersionSpan(version=s.version, start=s.start, end=s.end)
            for s in completion.version_spans
        ],
        sampling_params=sampling_to_proto(generated.sampling),
        text=completion.text,
        rollout_id=rollout_id,
    )


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, rollout: Rollout) -> None:
        self._rollout = rollout

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateResponse]:
        prompt = prompt_from_proto(request.prompt)
        sampling = sampling_from_proto(request.sampling_params)
        rollout_id = self._rollout.rollout_id
        async for generated in self._rollout.generate(request.request_id, prompt, sampling):
            yield rollout_pb2.GenerateResponse(completion=completion_to_proto(generated, rollout_id))

    async def StageWeights(
        self, request: rollout_pb2.StageWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.StageWeightsResponse:
        staged = await self._rollout.stage_weights(transports.target_from_proto(request.weight_version))
        return rollout_pb2.StageWeightsResponse(
            version=staged.version, bytes=staged.manifest.total_bytes, fetch_ms=staged.fetch_ms
        )

    async def CommitWeights(
        self, request: rollout_pb2.CommitWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.CommitWeightsResponse:
        result = await self._rollout.commit_weights(request.version)
        return rollout_pb2.CommitWeightsResponse(
            version=result.version, load_ms=result.timings.load_ms, pause_ms=result.timings.pause_ms
        )

    async def AbortWeights(
        self, request: rollout_pb2.AbortWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.AbortWeightsResponse:
        await self._rollout.abort_weights(request.version)
        return rollout_pb2.AbortWeightsResponse()

    async def ScoreTokens(
        self, request: rollout_pb2.ScoreTokensRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.ScoreTokensResponse:
        sequence = request.sequence
        logprobs, version = await self._rollout.score(
            list(sequence.prompt_token_ids), list(sequence.completion_token_ids), sequence.temperature
        )
        return rollout_pb2.ScoreTokensResponse(logprobs=logprobs, weight_version=version)

    async def GetRolloutState(
        self, request: rollout_pb2.GetRolloutStateRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.GetRolloutStateResponse:
        state = self._rollout.state()
        return rollout_pb2.GetRolloutStateResponse(
            rollout_id=state.rollout_id,
            weight_version=state.weight_version,
            staged_version=state.staged_version,
            status=_STATUS[state.status],
            engine=state.engine,
            model=state.model,
            in_flight=state.in_flight,
            max_in_flight=state.max_in_flight,
            tokens_generated=state.tokens_generated,
            weight_workers=state.weight_workers,
            instance_id=state.instance_id,
        )
