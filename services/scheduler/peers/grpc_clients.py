"""The scheduler's peers over gRPC: the one implementation of each protocol in `clients.py`.

Each client builds the request messages, puts the configured deadline on every call, and lets
`GrpcClient` turn a failed call into a domain error from the one client-side table
(`services.common.errors`). Channels open lazily, inside the running loop.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TypeVar

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2, env_pb2_grpc
from grpo.learner.v1 import learner_pb2, learner_pb2_grpc
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import GrpcClient
from services.scheduler.peers.clients import (
    Batch,
    EnvInfo,
    LearnerInfo,
    PreparedWeights,
    Rendered,
    RolloutInfo,
    Sampling,
    Scores,
    Split,
    StepResult,
    TokenScores,
)
from services.scheduler.peers.config import GenerateBatchSettings, TimeoutSettings
from services.scheduler.peers.grpc_generate import GenerateBatcher
from services.transports import Receiver, TransportKind
from services.transports.cuda_ipc_fence import Holder
from services.transports.kinds import kind_to_proto, receive_bound_s

_SPLITS = {"train": env_pb2.SPLIT_TRAIN, "eval": env_pb2.SPLIT_EVAL}
_READY = (rollout_pb2.ROLLOUT_STATUS_READY, rollout_pb2.ROLLOUT_STATUS_UPDATING)

StubT = TypeVar("StubT")


def transfer_timeout(timeouts: TimeoutSettings, message: types_pb2.WeightVersion) -> float:
    """How long a rollout's stage of `message`, and then its commit, may take: the configured transfer
    deadline for its bytes, or a collective transport's own bound (plus slack for the RPCs) when that
    is longer."""
    bound = timeouts.transfer.for_bytes(message.total_bytes)
    collective = receive_bound_s(message)
    return bound if collective is None else max(bound, collective + 10.0)


class _PeerClient(GrpcClient[StubT]):
    """A scheduler peer: its stub, the configured deadlines, and errors named "<label> <address>"."""

    def __init__(self, address: str, stub_class: type[StubT], label: str, timeouts: TimeoutSettings) -> None:
        super().__init__(address, stub_class)
        self._label = label
        self._timeouts = timeouts

    @property
    def peer(self) -> str:
        return f"{self._label} {self.address}"


@functools.lru_cache(maxsize=16)
def _sampling_params(sampling: Sampling) -> types_pb2.SamplingParams:
    """The proto of a (frozen, hashable) `Sampling`, built once: callers copy it, never mutate it."""
    return types_pb2.SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        seed=sampling.seed,
    )


class GrpcEnvClient(_PeerClient[env_pb2_grpc.EnvironmentServiceStub]):
    def __init__(self, address: str, timeouts: TimeoutSettings) -> None:
        super().__init__(address, env_pb2_grpc.EnvironmentServiceStub, "env", timeouts)

    async def describe(self) -> EnvInfo:
        request = env_pb2.DescribeEnvironmentRequest()
        d = await self.unary("DescribeEnvironment", request, self._timeouts.control)
        return EnvInfo(
            d.name,
            max(1, d.max_turns),
            d.respond_timeout_seconds or 30.0,
            d.episode_timeout_seconds,
            d.max_episode_tokens,
            tuple(d.levels),
            d.success_threshold,
        )

    async def sample(
        self, n: int, split: Split, start: int | None = None, level: str | None = None
    ) -> list[types_pb2.Prompt]:
        request = env_pb2.SamplePromptsRequest(n=n, split=_SPLITS[split], start=start, level=level)
        response = await self.unary("SamplePrompts", request, self._timeouts.control)
        return list(response.prompts)

    async def respond(
        self, prompt: types_pb2.Prompt, transcripts: Sequence[types_pb2.Transcript]
    ) -> list[env_pb2.EnvReply]:
        request = env_pb2.RespondRequest(prompt=prompt, transcripts=transcripts)
        # the env answers each episode within its own respond deadline (tools included)
        return list((await self.unary("Respond", request, self._timeouts.score)).replies)

    async def score(self, prompt: types_pb2.Prompt, transcripts: Sequence[types_pb2.Transcript]) -> Scores:
        request = env_pb2.ScoreCompletionsRequest(prompt=prompt, transcripts=transcripts)
        response = await self.unary("ScoreCompletions", request, self._timeouts.score)
        return Scores(list(response.rewards), list(response.reward_infos), response.skip_group)

    async def evaluate(
        self, groups: Sequence[tuple[types_pb2.Prompt, Sequence[types_pb2.Transcript]]]
    ) -> dict[str, float]:
        request = env_pb2.EvaluateRequest(
            groups=[env_pb2.ScoreCompletionsRequest(prompt=p, transcripts=ts) for p, ts in groups]
        )
        return dict((await self.unary("Evaluate", request, self._timeouts.score)).metrics)


class GrpcLearnerClient(_PeerClient[learner_pb2_grpc.LearnerServiceStub]):
    def __init__(self, address: str, timeouts: TimeoutSettings) -> None:
        super().__init__(address, learner_pb2_grpc.LearnerServiceStub, "learner", timeouts)

    async def state(self) -> LearnerInfo:
        s = await self.unary("GetLearnerState", learner_pb2.GetLearnerStateRequest(), self._timeouts.control)
        return LearnerInfo(s.weight_version, s.step, s.loss, s.last_batch_id, s.lineage_id, s.instance_id)

    async def train_step(self, batch: Batch) -> StepResult:
        message = types_pb2.TrainBatch(batch_id=batch.batch_id, step=batch.step)
        for group, advantages in zip(batch.groups, batch.advantages, strict=True):
            message.groups.append(
                types_pb2.ScoredGroup(
                    group_id=group.group_id,
                    prompt=group.prompt,
                    completions=group.completions,
                    rewards=group.rewards,
                    advantages=advantages,
                    reward_infos=group.reward_infos,
                    prompt_token_ids=group.prompt_token_ids,
                    sampling_params=group.sampling_params,
                    rollout_id=group.rollout_id,
                )
            )
        request = learner_pb2.TrainStepRequest(batch=message)
        response = await self.unary("TrainStep", request, self._timeouts.train_step)
        result = response.result
        logprobs = [list(c.logprobs) for c in response.completion_logprobs]
        return StepResult(result.step, result.weight_version, dict(result.metrics), logprobs)

    async def prepare(
        self, kind: TransportKind, receivers: Sequence[Receiver] = (), holders: Sequence[Holder] | None = None
    ) -> PreparedWeights:
        request = learner_pb2.PrepareWeightsRequest(
            transport=kind_to_proto(kind),
            receivers=[
                learner_pb2.WeightReceiver(
                    rollout_id=r.rollout_id, instance_id=r.instance_id, workers=r.workers
                )
                for r in receivers
            ],
            holders=[
                learner_pb2.WeightHolder(
                    rollout_id=h.rollout_id, instance_id=h.instance_id, version=h.version,
                    owns_weights=h.owns_weights,
                )
                for h in holders or ()
            ],
            holders_listed=holders is not None,
        )  # fmt: skip
        response = await self.unary("PrepareWeights", request, self._timeouts.weight_sync)
        wv = response.weight_version
        return PreparedWeights(wv.version, wv, response.prepare_ms, transfer_timeout(self._timeouts, wv))

    async def release(self, version: int) -> None:
        request = learner_pb2.ReleaseWeightsRequest(version=version)
        await self.unary("ReleaseWeights", request, self._timeouts.control)

    async def score_tokens(self, sequence: types_pb2.TokenSequence) -> TokenScores:
        request = learner_pb2.ScoreTokensRequest(sequence=sequence)
        response = await self.unary("ScoreTokens", request, self._timeouts.control)
        return TokenScores(list(response.logprobs), response.weight_version)

    async def restore(self, lineage_id: str, max_step: int, min_step: int = 0) -> int:
        request = learner_pb2.RestoreCheckpointRequest(
            lineage_id=lineage_id, max_step=max_step, min_step=min_step
        )
        # the learner reloads its model from a checkpoint: as long as a train step may take
        response = await self.unary("RestoreCheckpoint", request, self._timeouts.train_step)
        return response.previous_step


class GrpcRolloutClient(_PeerClient[rollout_pb2_grpc.RolloutServiceStub]):
    def __init__(
        self,
        address: str,
        timeouts: TimeoutSettings,
        generate_batch: GenerateBatchSettings = GenerateBatchSettings(),  # noqa: B008 (frozen)
    ) -> None:
        super().__init__(address, rollout_pb2_grpc.RolloutServiceStub, "rollout", timeouts)
        self.batcher = GenerateBatcher(self, timeouts.generate, generate_batch)

    async def state(self) -> RolloutInfo:
        request = rollout_pb2.GetRolloutStateRequest()
        s = await self.unary("GetRolloutState", request, self._timeouts.health)
        return RolloutInfo(
            s.rollout_id or self.address,
            s.weight_version,
            s.status in _READY,
            s.max_in_flight,
            max(1, s.weight_workers),
            s.instance_id,
            s.max_model_len,
        )

    async def generate(
        self,
        request_id: str,
        prompt: types_pb2.Prompt,
        sampling: Sampling,
        prompt_token_ids: Sequence[int] = (),
    ) -> list[types_pb2.Completion]:
        """One group (or one episode's turn, token-in), sent with the others issued to this rollout
        within the batching window (`grpc_generate.py`)."""
        request = rollout_pb2.GenerateRequest(
            request_id=request_id,
            prompt=prompt,
            sampling_params=_sampling_params(sampling),
            prompt_token_ids=prompt_token_ids,
        )
        return await self.batcher.generate(request, sampling.n)

    async def render_bridge(
        self, messages: Sequence[types_pb2.ChatMessage], previous_tail: Sequence[int], tools_json: str = ""
    ) -> Rendered:
        request = rollout_pb2.RenderMessagesRequest(
            mode=rollout_pb2.RENDER_MODE_BRIDGE,
            messages=messages,
            tools_json=tools_json,
            add_generation_prompt=True,
            previous_tail=previous_tail,
        )
        response = await self.unary("RenderMessages", request, self._timeouts.control)
        return Rendered(list(response.token_ids), response.text)

    async def stage(
        self, weights: types_pb2.WeightVersion, deadline_s: float | None = None, rewind: bool = False
    ) -> int:
        request = rollout_pb2.StageWeightsRequest(weight_version=weights, rewind=rewind)
        deadline = transfer_timeout(self._timeouts, weights) if deadline_s is None else deadline_s
        response = await self.unary("StageWeights", request, deadline)
        # an unchanged version's delta moves 0 bytes; unset: a rollout from before received_bytes
        return response.received_bytes if response.HasField("received_bytes") else response.bytes

    async def commit(self, version: int, rewind: bool = False, deadline_s: float | None = None) -> None:
        request = rollout_pb2.CommitWeightsRequest(version=version, rewind=rewind)
        deadline = self._timeouts.weight_sync if deadline_s is None else deadline_s
        await self.unary("CommitWeights", request, deadline)

    async def abort(self, version: int) -> None:
        await self.unary(
            "AbortWeights", rollout_pb2.AbortWeightsRequest(version=version), self._timeouts.control
        )

    async def score_tokens(self, sequence: types_pb2.TokenSequence) -> TokenScores:
        request = rollout_pb2.ScoreTokensRequest(sequence=sequence)
        tokens = len(sequence.prompt_token_ids) + len(sequence.completion_token_ids)
        deadline = self._timeouts.probe + tokens / self._timeouts.probe_tokens_per_s
        response = await self.unary("ScoreTokens", request, deadline)
        return TokenScores(list(response.logprobs), response.weight_version)

    async def close(self) -> None:
        await self.batcher.close()
        await super().close()
