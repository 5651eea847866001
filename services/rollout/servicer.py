"""RolloutService gRPC handlers: translate protos <-> domain objects and call `Rollout`. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.errors import code_number, status_for
from services.rollout.engine import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP, FinishedCompletion, Sampling
from services.rollout.rollout import BatchOutput, BatchRequest, Generated, Rollout, Status
from services.rollout.templates import MessageInput, ToolCallInput
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
_RENDER_MODE = {
    rollout_pb2.RENDER_MODE_CONVERSATION: "conversation",
    rollout_pb2.RENDER_MODE_BRIDGE: "bridge",
    rollout_pb2.RENDER_MODE_TEXT: "text",
}


def prompt_from_proto(message: types_pb2.Prompt, token_ids: Sequence[int] = ()) -> PromptInput:
    return PromptInput(
        prompt_id=message.id,
        text=message.text,
        messages=tuple((m.role, m.content) for m in message.messages),
        tools_json=message.tools_json,
        token_ids=tuple(token_ids),
    )


def message_from_proto(message: types_pb2.ChatMessage) -> MessageInput:
    return MessageInput(
        role=message.role,
        content=message.content,
        tool_calls=tuple(ToolCallInput(c.id, c.name, c.arguments_json) for c in message.tool_calls),
        tool_call_id=message.tool_call_id,
        name=message.name,
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


def completion_template(generated: Generated, rollout_id: str) -> types_pb2.Completion:
    """The fields all completions of one request share: prompt, sampling parameters, rollout id."""
    return types_pb2.Completion(
        prompt_id=generated.prompt_id,
        prompt_token_ids=generated.prompt_token_ids,
        sampling_params=sampling_to_proto(generated.sampling),
        rollout_id=rollout_id,
    )


def fill_completion(
    message: types_pb2.Completion, completion: FinishedCompletion, template: types_pb2.Completion
) -> None:
    """Write one completion into `message` (in place): the request's `template`, then its own fields."""
    message.CopyFrom(template)
    message.index = completion.index
    message.completion_token_ids.extend(completion.token_ids)
    message.logprobs.extend(completion.logprobs)
    finish = _FINISH.get(completion.finish_reason, types_pb2.FINISH_REASON_UNSPECIFIED)
    message.finish_reason = finish
    # the one-turn case of an episode: a single model turn over all the tokens
    message.turns.add(
        source=types_pb2.TURN_SOURCE_MODEL, start=0, end=len(completion.token_ids), finish_reason=finish
    )
    for span in completion.version_spans:
        message.version_spans.add(version=span.version, start=span.start, end=span.end)
    message.text = completion.text


def generate_response(generated: Generated, template: types_pb2.Completion) -> rollout_pb2.GenerateResponse:
    """One stream message: the completions of the request that finished together."""
    response = rollout_pb2.GenerateResponse()
    for completion in generated.completions:
        fill_completion(response.completions.add(), completion, template)
    return response


# A GenerateBatch response grows until its results pass this size, then the rest go in the next one:
# far below the message limit, and one response per engine step for any usual batch.
BATCH_RESPONSE_BYTES = 4 << 20


def batch_request_from_proto(message: rollout_pb2.GenerateRequest) -> BatchRequest:
    return BatchRequest(
        message.request_id,
        prompt_from_proto(message.prompt, message.prompt_token_ids),
        sampling_from_proto(message.sampling_params),
    )


def batch_responses(
    outputs: list[BatchOutput], templates: dict[str, types_pb2.Completion], rollout_id: str
) -> list[rollout_pb2.GenerateBatchResponse]:
    """The stream messages for outputs that finished together (usually one). `templates` keeps each
    request's shared completion fields, built from its first output."""
    responses = [rollout_pb2.GenerateBatchResponse()]
    size = 0
    for output in outputs:
        if size >= BATCH_RESPONSE_BYTES:
            responses.append(rollout_pb2.GenerateBatchResponse())
            size = 0
        result = responses[-1].results.add(request_id=output.request_id)
        if output.error is not None:
            code, message = status_for(output.error)
            result.error.code, result.error.message = code_number(code), message
        elif output.generated is not None:
            template = templates.get(output.request_id)
            if template is None:
                template = templates[output.request_id] = completion_template(output.generated, rollout_id)
            for completion in output.generated.completions:
                fill_completion(result.completions.add(), completion, template)
        size += result.ByteSize()
    return responses


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, rollout: Rollout) -> None:
        self._rollout = rollout

    async def Generate(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateResponse]:
        prompt = prompt_from_proto(request.prompt, request.prompt_token_ids)
        sampling = sampling_from_proto(request.sampling_params)
        template = None  # built from the first completions, copied into each
        async for generated in self._rollout.generate(request.request_id, prompt, sampling):
            if template is None:
                template = completion_template(generated, self._rollout.rollout_id)
            yield generate_response(generated, template)

    async def GenerateBatch(
        self, request: rollout_pb2.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateBatchResponse]:
        requests = [batch_request_from_proto(r) for r in request.requests]
        templates: dict[str, types_pb2.Completion] = {}
        async for outputs in self._rollout.generate_many(requests):
            for response in batch_responses(outputs, templates, self._rollout.rollout_id):
                yield response

    async def StageWeights(
        self, request: rollout_pb2.StageWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.StageWeightsResponse:
        staged = await self._rollout.stage_weights(
            transports.target_from_proto(request.weight_version), request.rewind
        )
        return rollout_pb2.StageWeightsResponse(
            version=staged.version,
            bytes=staged.manifest.total_bytes,
            fetch_ms=staged.fetch_ms,
            received_bytes=staged.received_bytes,
        )

    async def CommitWeights(
        self, request: rollout_pb2.CommitWeightsRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.CommitWeightsResponse:
        result = await self._rollout.commit_weights(request.version, request.rewind)
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
            max_model_len=state.max_model_len,
        )

    async def RenderMessages(
        self, request: rollout_pb2.RenderMessagesRequest, context: grpc.aio.ServicerContext
    ) -> rollout_pb2.RenderMessagesResponse:
        rendered = await self._rollout.render(
            _RENDER_MODE.get(request.mode, "unspecified"),
            [message_from_proto(m) for m in request.messages],
            tools_json=request.tools_json,
            add_generation_prompt=request.add_generation_prompt,
            previous_tail=list(request.previous_tail),
            text=request.text,
        )
        return rollout_pb2.RenderMessagesResponse(token_ids=rendered.token_ids, text=rendered.text)
