"""gRPC LearnerService: translates protos ↔ domain objects and calls LearnerApp. No logic here."""

from __future__ import annotations

from collections.abc import AsyncIterator

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common import weights
from services.common.errors import FailedPrecondition, InvalidArgument
from services.learner.app import LearnerApp
from services.learner.batching import Sample
from services.learner.publish import GRPC_STREAM, SHARED_MEMORY

_KINDS = {
    types_pb2.WEIGHT_TRANSPORT_KIND_GRPC_STREAM: GRPC_STREAM,
    types_pb2.WEIGHT_TRANSPORT_KIND_SHARED_MEMORY: SHARED_MEMORY,
}
_NOT_YET = {
    types_pb2.WEIGHT_TRANSPORT_KIND_CUDA_IPC: "cuda_ipc",
    types_pb2.WEIGHT_TRANSPORT_KIND_NCCL: "nccl",
    types_pb2.WEIGHT_TRANSPORT_KIND_CHECKPOINT: "checkpoint",
}


def samples_from_batch(batch: types_pb2.TrainBatch) -> tuple[list[Sample], list[float]]:
    """Flatten the groups of a TrainBatch into Samples (+ rewards), checking per-group counts."""
    if not batch.groups:
        raise InvalidArgument(f"batch {batch.batch_id!r} has no groups")
    samples: list[Sample] = []
    rewards: list[float] = []
    for gi, group in enumerate(batch.groups):
        where = f"group {gi} ({group.group_id!r})"
        n = len(group.completions)
        if n == 0:
            raise InvalidArgument(f"{where} has no completions")
        if len(group.advantages) != n:
            raise InvalidArgument(f"{where}: {len(group.advantages)} advantages for {n} completions")
        if group.rewards and len(group.rewards) != n:
            raise InvalidArgument(f"{where}: {len(group.rewards)} rewards for {n} completions")
        for ci, completion in enumerate(group.completions):
            if len(completion.logprobs) != len(completion.completion_token_ids):
                raise InvalidArgument(
                    f"{where} completion {ci}: {len(completion.logprobs)} logprobs for "
                    f"{len(completion.completion_token_ids)} completion tokens"
                )
            temperature = completion.sampling_params.temperature
            samples.append(
                Sample(
                    prompt_ids=tuple(completion.prompt_token_ids),
                    completion_ids=tuple(completion.completion_token_ids),
                    behav_logprobs=tuple(completion.logprobs),
                    advantage=float(group.advantages[ci]),
                    # vLLM reports unscaled logprobs for greedy (T=0) and unset params mean T=1
                    temperature=float(temperature) if temperature > 0 else 1.0,
                )
            )
        rewards.extend(float(r) for r in group.rewards)
    return samples, rewards


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self, app: LearnerApp) -> None:
        self.app = app

    async def TrainStep(self, request, context) -> learner_pb2.TrainStepResponse:
        samples, rewards = samples_from_batch(request.batch)
        outcome = await self.app.train_step(samples, request.batch.batch_id, request.batch.step, rewards)
        result = types_pb2.StepResult(step=outcome.step, weight_version=outcome.weight_version)
        result.metrics.update(outcome.metrics)
        return learner_pb2.TrainStepResponse(result=result)

    async def PrepareWeights(self, request, context) -> learner_pb2.PrepareWeightsResponse:
        kind = request.transport
        if kind in _NOT_YET:
            raise FailedPrecondition(f"weight transport {_NOT_YET[kind]} is not implemented yet")
        if kind not in _KINDS:
            raise InvalidArgument(
                f"unsupported weight transport kind {kind} (use GRPC_STREAM or SHARED_MEMORY)"
            )
        item, prepare_ms = await self.app.prepare_weights(_KINDS[kind])
        wv = types_pb2.WeightVersion(version=item.version, parent_version=item.version - 1)
        weights.manifest_to_proto(item.manifest, wv)
        if item.kind == GRPC_STREAM:
            wv.grpc_stream.address = self.app.advertise_address()
            wv.grpc_stream.chunk_bytes = self.app.settings.weight_chunk_bytes
        else:
            wv.shared_memory.segment_name = item.segment_name
            wv.shared_memory.size = item.manifest.total_bytes
        return learner_pb2.PrepareWeightsResponse(weight_version=wv, prepare_ms=prepare_ms)

    async def FetchWeights(self, request, context) -> AsyncIterator[learner_pb2.FetchWeightsResponse]:
        async for bucket, offset, data in self.app.fetch_chunks(request.version, list(request.buckets)):
            chunk = types_pb2.WeightChunk(version=request.version, bucket=bucket, offset=offset, data=data)
            yield learner_pb2.FetchWeightsResponse(chunk=chunk)

    async def ReleaseWeights(self, request, context) -> learner_pb2.ReleaseWeightsResponse:
        await self.app.release_weights(request.version)
        return learner_pb2.ReleaseWeightsResponse()

    async def ScoreTokens(self, request, context) -> learner_pb2.ScoreTokensResponse:
        seq = request.sequence
        logprobs, version = await self.app.score(
            list(seq.prompt_token_ids), list(seq.completion_token_ids), seq.temperature
        )
        return learner_pb2.ScoreTokensResponse(logprobs=logprobs, weight_version=version)

    async def GetLearnerState(self, request, context) -> learner_pb2.GetLearnerStateResponse:
        s = self.app.state()
        return learner_pb2.GetLearnerStateResponse(
            weight_version=s.weight_version,
            step=s.step,
            model=s.model,
            loss=s.loss,
            prepared_versions=s.prepared_versions,
            device=s.device,
            dtype=s.dtype,
        )
