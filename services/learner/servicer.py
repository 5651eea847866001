"""gRPC LearnerService: translates protos ↔ domain objects and calls `Learner`. No logic here.

`TrainStep` hands the learner a decoder (`samples_from_batch` bound to the request) instead of
decoded samples: converting every token and logprob is O(tokens) and runs on the model thread.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

from grpo.common.v1 import types_pb2
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from services.common import validation as check
from services.common.errors import InvalidArgument
from services.learner.batching import Sample
from services.learner.learner import Decoded, Learner
from services.transports import Receiver
from services.transports import registry as transports
from services.transports.cuda_ipc_fence import Holder


def samples_from_batch(batch: types_pb2.TrainBatch) -> Decoded:
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
        check.all_finite(group.rewards, f"{where}.rewards")  # advantages and logprobs: validate_sample
        for ci, (completion, advantage) in enumerate(zip(group.completions, group.advantages, strict=True)):
            field = f"{where}.completions[{ci}]"
            # per-group facts travel once in the group; a member's own fields win when set
            sampling = (
                completion.sampling_params
                if completion.HasField("sampling_params")
                else group.sampling_params
            )
            samples.append(
                Sample(
                    prompt_ids=tuple(completion.prompt_token_ids or group.prompt_token_ids),
                    completion_ids=tuple(completion.completion_token_ids),
                    behav_logprobs=tuple(completion.logprobs),
                    advantage=float(advantage),
                    temperature=check.temperature(
                        sampling.temperature, f"{field}.sampling_params.temperature"
                    ),
                    env_spans=env_spans(completion, field),
                )
            )
        rewards.extend(float(r) for r in group.rewards)
    return samples, rewards


def env_spans(completion: types_pb2.Completion, where: str) -> tuple[tuple[int, int], ...]:
    """The environment turns of an episode as [start, end) ranges; its turns must tile the completion
    in order (no turns: one model turn, nothing masked)."""
    position = 0
    spans: list[tuple[int, int]] = []
    for ti, turn in enumerate(completion.turns):
        if turn.start != position or turn.end < turn.start:
            raise InvalidArgument(
                f"{where}.turns[{ti}]: [{turn.start}, {turn.end}) does not continue at {position}"
            )
        if turn.source == types_pb2.TURN_SOURCE_ENV:
            spans.append((turn.start, turn.end))
        elif turn.source != types_pb2.TURN_SOURCE_MODEL:
            raise InvalidArgument(f"{where}.turns[{ti}].source must be MODEL or ENV")
        position = turn.end
    if completion.turns and position != len(completion.completion_token_ids):
        raise InvalidArgument(
            f"{where}.turns cover {position} of {len(completion.completion_token_ids)} completion tokens"
        )
    return tuple(spans)


class LearnerServicer(learner_pb2_grpc.LearnerServiceServicer):
    def __init__(self, learner: Learner) -> None:
        self.learner = learner

    async def TrainStep(self, request, context) -> learner_pb2.TrainStepResponse:
        batch = request.batch
        outcome = await self.learner.train_step(lambda: samples_from_batch(batch), batch.batch_id, batch.step)
        result = types_pb2.StepResult(step=outcome.step, weight_version=outcome.weight_version)
        # a batch whose loss overflowed skipped its update (update_skipped = 1): its inf/NaN metrics
        # are left out rather than sent as numbers nobody can plot
        result.metrics.update({k: v for k, v in outcome.metrics.items() if math.isfinite(v)})
        response = learner_pb2.TrainStepResponse(result=result)
        for logprobs in outcome.logprobs:  # per completion, in the batch's order
            response.completion_logprobs.add().logprobs.extend(logprobs.tolist())
        return response

    async def PrepareWeights(self, request, context) -> learner_pb2.PrepareWeightsResponse:
        receivers = tuple(Receiver(r.rollout_id, r.instance_id, r.workers) for r in request.receivers)
        holders = None
        if request.holders_listed:
            holders = [
                Holder(h.rollout_id, h.instance_id, h.version, h.owns_weights) for h in request.holders
            ]
        prepared, prepare_ms = await self.learner.prepare_weights(
            transports.kind_from_proto(request.transport), receivers, holders
        )
        return learner_pb2.PrepareWeightsResponse(
            weight_version=transports.describe(prepared, self.learner.adapter), prepare_ms=prepare_ms
        )

    async def FetchWeights(self, request, context) -> AsyncIterator[bytes]:
        # FetchWeightsResponse messages already in wire form (chunk_wire: no copies through protobuf);
        # server.py registers this method to send them as they are
        chunks = self.learner.fetch_chunks(request.version, list(request.buckets), request.base_version)
        async for message in chunks:
            yield message

    async def ReleaseWeights(self, request, context) -> learner_pb2.ReleaseWeightsResponse:
        await self.learner.release_weights(request.version)
        return learner_pb2.ReleaseWeightsResponse()

    async def ScoreTokens(self, request, context) -> learner_pb2.ScoreTokensResponse:
        seq = request.sequence
        logprobs, version = await self.learner.score(
            list(seq.prompt_token_ids), list(seq.completion_token_ids), seq.temperature
        )
        return learner_pb2.ScoreTokensResponse(logprobs=logprobs, weight_version=version)

    async def GetLearnerState(self, request, context) -> learner_pb2.GetLearnerStateResponse:
        s = self.learner.state()
        return learner_pb2.GetLearnerStateResponse(
            weight_version=s.weight_version,
            step=s.step,
            model=s.model,
            loss=s.loss,
            prepared_versions=s.prepared_versions,
            device=s.device,
            dtype=s.dtype,
            last_batch_id=s.last_batch_id,
            lineage_id=s.lineage_id,
            instance_id=s.instance_id,
            ranks=s.ranks,
            sharded=s.sharded,
        )

    async def RestoreCheckpoint(self, request, context) -> learner_pb2.RestoreCheckpointResponse:
        r = await self.learner.restore(request.lineage_id, request.max_step, request.min_step)
        return learner_pb2.RestoreCheckpointResponse(
            step=r.step, weight_version=r.weight_version, last_batch_id=r.last_batch_id,
            previous_step=r.previous_step,
        )  # fmt: skip
