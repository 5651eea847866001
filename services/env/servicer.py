"""gRPC EnvironmentService: translates protos ↔ domain objects and calls `EnvHost`. No logic here."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2, env_pb2_grpc
from services.common.errors import InvalidArgument
from services.env.base import Message, PromptItem, Reply, Score, SplitName, final_text
from services.env.host import EnvHost, ScoredGroupOutcome, ScoreJob

_SPLITS: dict[int, SplitName] = {
    env_pb2.SPLIT_UNSPECIFIED: "train",
    env_pb2.SPLIT_TRAIN: "train",
    env_pb2.SPLIT_EVAL: "eval",
}
_POLICIES = {
    "skip_group": env_pb2.FAILURE_POLICY_SKIP_GROUP,
    "assign_value": env_pb2.FAILURE_POLICY_ASSIGN_VALUE,
}


def message_from_proto(message: types_pb2.ChatMessage) -> Message:
    """A chat message as environments see it (base.Message): tool calls and ids only when present."""
    out: Message = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "name": c.name, "arguments": c.arguments_json} for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    if message.name:
        out["name"] = message.name
    return out


def message_to_proto(message: Message) -> types_pb2.ChatMessage:
    """An environment's message on the wire; a message that is not one is the environment's bug."""
    if not isinstance(message, dict) or not isinstance(message.get("content", ""), str):
        raise TypeError(f"a message must be a dict with a str content, got {message!r:.200}")
    out = types_pb2.ChatMessage(
        role=str(message.get("role", "")),
        content=message.get("content", ""),
        tool_call_id=str(message.get("tool_call_id", "")),
        name=str(message.get("name", "")),
    )
    for call in message.get("tool_calls") or ():
        arguments = call.get("arguments", "{}")
        out.tool_calls.add(
            id=str(call.get("id", "")),
            name=str(call.get("name", "")),
            arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments),
        )
    return out


def reply_to_proto(reply: Reply | str) -> env_pb2.EnvReply:
    """One episode's reply; a failure text, or a reply the wire cannot carry, ends the episode."""
    if isinstance(reply, str):
        return env_pb2.EnvReply(done=True, failure=reply)
    try:
        out = env_pb2.EnvReply(
            messages=[message_to_proto(m) for m in reply.messages],
            done=bool(reply.done),
            tool_calls=reply.tool_calls,
            tool_errors=reply.tool_errors,
        )
    except (TypeError, ValueError) as exc:
        return env_pb2.EnvReply(done=True, failure=f"bad_output: {exc}")
    if reply.reward is not None:
        if not math.isfinite(reply.reward):
            return env_pb2.EnvReply(done=True, failure=f"bad_output: per-turn reward {reply.reward!r}")
        out.reward = reply.reward
    if not out.done and not out.messages:
        out.done, out.failure = True, "bad_output: respond returned no messages and done=False"
    return out


def prompt_to_proto(item: PromptItem, env_name: str, tools_json: str = "") -> types_pb2.Prompt:
    prompt = types_pb2.Prompt(
        id=item.id,
        env_name=env_name,
        text=item.text,
        reference_answer=item.reference_answer,
        tools_json=tools_json,
    )
    for message in item.messages:
        prompt.messages.add(role=message["role"], content=message["content"])
    prompt.metadata.update(item.metadata)
    return prompt


def prompt_from_proto(prompt: types_pb2.Prompt) -> PromptItem:
    return PromptItem(
        id=prompt.id,
        text=prompt.text,
        messages=tuple({"role": m.role, "content": m.content} for m in prompt.messages),
        reference_answer=prompt.reference_answer,
        metadata=dict(prompt.metadata),
    )


def reward_info(score: Score) -> types_pb2.RewardInfo:
    ok = not score.failure and score.reward is not None
    info = types_pb2.RewardInfo(ok=ok, failure=score.failure, parsed_answer=score.parsed_answer)
    info.details.update({str(k): str(v) for k, v in score.details.items()})
    return info


def outcome_to_proto(outcome: ScoredGroupOutcome) -> env_pb2.ScoreCompletionsResponse:
    return env_pb2.ScoreCompletionsResponse(
        rewards=outcome.rewards,
        reward_infos=[reward_info(s) for s in outcome.scores],
        skip_group=outcome.skip_group,
        failed_count=outcome.failed_count,
    )


def job_from_proto(host: EnvHost, request: env_pb2.ScoreCompletionsRequest, where: str = "") -> ScoreJob:
    if not request.HasField("prompt"):
        raise InvalidArgument(f"{where}prompt is required")
    if not host.env_name_matches(request.prompt.env_name):
        raise InvalidArgument(
            f"{where}prompt {request.prompt.id!r} is from environment {request.prompt.env_name!r}, "
            f"this service serves {host.name!r}"
        )
    if request.transcripts:
        if request.completions:
            raise InvalidArgument(f"{where}set transcripts or completions, not both")
        transcripts = [[message_from_proto(m) for m in t.messages] for t in request.transcripts]
        return ScoreJob(
            prompt=prompt_from_proto(request.prompt),
            completions=[final_text(t) for t in transcripts],
            completion_prompt_ids=[],
            transcripts=transcripts,
            failures=[t.failure for t in request.transcripts],
        )
    return ScoreJob(
        prompt=prompt_from_proto(request.prompt),
        completions=[c.text for c in request.completions],
        completion_prompt_ids=[c.prompt_id for c in request.completions],
    )


def _jobs(host: EnvHost, groups: list[env_pb2.ScoreCompletionsRequest]) -> list[ScoreJob]:
    return [job_from_proto(host, group, f"group {i}: ") for i, group in enumerate(groups)]


class EnvironmentServicer(env_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, host: EnvHost) -> None:
        self.host = host

    async def DescribeEnvironment(self, request, context) -> env_pb2.DescribeEnvironmentResponse:
        d = self.host.describe()
        low, high = d["reward_range"]
        response = env_pb2.DescribeEnvironmentResponse(
            name=d["name"],
            description=d["description"],
            options_json=json.dumps(d["options"], sort_keys=True),
            train_size=d["train_size"],
            eval_size=d["eval_size"],
            failure_policy=_POLICIES[d["failure_policy"]],
            failure_reward=d["failure_reward"],
            score_timeout_seconds=d["score_timeout_seconds"],
            success_threshold=d["success_threshold"],
            max_turns=d["max_turns"],
            tools_json=d["tools_json"],
            respond_timeout_seconds=d["respond_timeout_seconds"],
            episode_timeout_seconds=d["episode_timeout_seconds"],
            max_episode_tokens=d["max_episode_tokens"],
            levels=d["levels"],
        )
        if math.isfinite(low):
            response.reward_min = low
        if math.isfinite(high):
            response.reward_max = high
        return response

    async def SamplePrompts(self, request, context) -> env_pb2.SamplePromptsResponse:
        if request.split not in _SPLITS:
            raise InvalidArgument(f"unknown split {request.split}")
        start = request.start if request.HasField("start") else None
        level = request.level if request.HasField("level") else None
        draw = await self.host.sample(request.n, _SPLITS[request.split], start, level)
        env_name, tools = self.host.name, self.host.tools_json
        return env_pb2.SamplePromptsResponse(
            prompts=[prompt_to_proto(item, env_name, tools) for item in draw.prompts],
            next_position=draw.next_position,
        )

    async def ScoreCompletions(self, request, context) -> env_pb2.ScoreCompletionsResponse:
        outcome = await self.host.score(job_from_proto(self.host, request))
        return outcome_to_proto(outcome)

    async def ScoreCompletionsStream(
        self, request, context
    ) -> AsyncIterator[env_pb2.ScoreCompletionsStreamResponse]:
        if not request.groups:
            raise InvalidArgument("no groups to score")
        async for index, outcome in self.host.score_many(_jobs(self.host, list(request.groups))):
            yield env_pb2.ScoreCompletionsStreamResponse(index=index, result=outcome_to_proto(outcome))

    async def Evaluate(self, request, context) -> env_pb2.EvaluateResponse:
        metrics, outcomes = await self.host.evaluate(_jobs(self.host, list(request.groups)))
        response = env_pb2.EvaluateResponse(results=[outcome_to_proto(o) for o in outcomes])
        response.metrics.update(metrics)
        return response

    async def Respond(self, request, context) -> env_pb2.RespondResponse:
        if not request.HasField("prompt"):
            raise InvalidArgument("prompt is required")
        if not self.host.env_name_matches(request.prompt.env_name):
            raise InvalidArgument(
                f"prompt {request.prompt.id!r} is from environment {request.prompt.env_name!r}, "
                f"this service serves {self.host.name!r}"
            )
        transcripts = [[message_from_proto(m) for m in t.messages] for t in request.transcripts]
        replies = await self.host.respond(prompt_from_proto(request.prompt), transcripts)
        return env_pb2.RespondResponse(replies=[reply_to_proto(r) for r in replies])

    async def GetEnvironmentState(self, request, context) -> env_pb2.GetEnvironmentStateResponse:
        positions = self.host.positions()
        response = env_pb2.GetEnvironmentStateResponse(
            train_position=positions["train"], eval_position=positions["eval"]
        )
        response.level_positions.update(self.host.level_positions())
        response.metrics.update(self.host.metrics())
        return response
