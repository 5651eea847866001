"""EnvironmentService over a real in-process gRPC server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from grpo.common.v1 import types_pb2
from grpo.env.v1 import env_pb2, env_pb2_grpc
from services.common.clients import open_channel
from services.common.serve import start_server
from services.env.config import EnvSettings
from services.env.server import EnvApp

FAULTY = str(Path(__file__).parent / "faulty_envs.py")
SERVICE_NAME = "grpo.env.v1.EnvironmentService"
T = 30.0  # deadline of every test RPC


async def serve(
    **overrides,
) -> AsyncIterator[tuple[env_pb2_grpc.EnvironmentServiceStub, health_pb2_grpc.HealthStub]]:
    settings = EnvSettings(port=0, **overrides)
    running = await start_server(EnvApp(settings), settings)
    channel = open_channel(running.address)
    try:
        yield env_pb2_grpc.EnvironmentServiceStub(channel), health_pb2_grpc.HealthStub(channel)
    finally:
        await channel.close()
        await running.close()


@pytest.fixture
async def arithmetic():
    async for stubs in serve(spec="arithmetic"):
        yield stubs


def test_service_names_come_from_the_contract() -> None:
    assert EnvApp.service_names == (SERVICE_NAME,)


def group(prompt: types_pb2.Prompt, *texts: str) -> env_pb2.ScoreCompletionsRequest:
    completions = [types_pb2.Completion(prompt_id=prompt.id, index=i, text=t) for i, t in enumerate(texts)]
    return env_pb2.ScoreCompletionsRequest(prompt=prompt, completions=completions)


async def test_describe_sample_score(arithmetic) -> None:
    stub, _ = arithmetic
    d = await stub.DescribeEnvironment(env_pb2.DescribeEnvironmentRequest(), timeout=T)
    assert (d.name, d.train_size, d.eval_size) == ("arithmetic", 0, 200)
    assert d.failure_policy == env_pb2.FAILURE_POLICY_SKIP_GROUP and (d.reward_min, d.reward_max) == (
        0.0,
        1.0,
    )
    assert '"digits": 2' in d.options_json

    first = await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=4, split=env_pb2.SPLIT_TRAIN), timeout=T)
    assert first.next_position == 4 and all(p.env_name == "arithmetic" and p.text for p in first.prompts)
    replay = await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=4, start=0), timeout=T)
    assert [p.text for p in replay.prompts] == [p.text for p in first.prompts]

    prompt = first.prompts[0]
    scored = await stub.ScoreCompletions(group(prompt, prompt.reference_answer, "nonsense"), timeout=T)
    assert list(scored.rewards) == [1.0, 0.0]
    assert [i.ok for i in scored.reward_infos] == [True, True]
    assert scored.reward_infos[0].parsed_answer == prompt.reference_answer
    assert not scored.skip_group and scored.failed_count == 0


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.ClearField("prompt"), "prompt is required"),
        (lambda r: r.ClearField("completions"), "no completions"),
        (lambda r: setattr(r.prompt, "env_name", "gsm8k"), "is from environment 'gsm8k'"),
        (lambda r: r.prompt.messages.add(role="user", content="hi"), "both text and messages"),
        (lambda r: setattr(r.completions[0], "prompt_id", "other"), "belongs to prompt 'other'"),
    ],
)
async def test_malformed_score_requests(arithmetic, mutate, message) -> None:
    stub, _ = arithmetic
    [prompt] = (await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=1), timeout=T)).prompts
    request = group(prompt, "1")
    mutate(request)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ScoreCompletions(request, timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


async def test_malformed_sample_requests(arithmetic) -> None:
    stub, _ = arithmetic
    for request in (env_pb2.SamplePromptsRequest(n=0), env_pb2.SamplePromptsRequest(n=10**6)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.SamplePrompts(request, timeout=T)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be in" in err.value.details()


async def test_stream_evaluate_and_state(arithmetic) -> None:
    stub, _ = arithmetic
    prompts = (
        await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=3, split=env_pb2.SPLIT_EVAL), timeout=T)
    ).prompts
    assert [p.id for p in prompts] == [f"arithmetic-eval-{i}" for i in range(3)]
    groups = [group(p, p.reference_answer, "x") for p in prompts]
    seen = {}
    async for item in stub.ScoreCompletionsStream(
        env_pb2.ScoreCompletionsStreamRequest(groups=groups), timeout=T
    ):
        seen[item.index] = list(item.result.rewards)
    assert seen == {0: [1.0, 0.0], 1: [1.0, 0.0], 2: [1.0, 0.0]}

    groups[2] = group(prompts[2], "x", "y")
    result = await stub.Evaluate(env_pb2.EvaluateRequest(groups=groups), timeout=T)
    m = dict(result.metrics)
    assert m["eval/num_prompts"] == 3 and m["eval/accuracy"] == pytest.approx(2 / 6)
    assert m["eval/pass@1"] == pytest.approx(1 / 3) and m["eval/pass@2"] == pytest.approx(2 / 3)
    assert [list(r.rewards) for r in result.results] == [[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]]

    state = await stub.GetEnvironmentState(env_pb2.GetEnvironmentStateRequest(), timeout=T)
    assert state.eval_position == 3 and state.train_position == 0
    assert state.metrics["env/scored_completions"] == 12 and state.metrics["env/failures"] == 0
    assert state.metrics["env/evaluations"] == 1


async def test_failures_are_recorded_and_service_stays_serving() -> None:
    async for stub, health in serve(
        spec=f"{FAULTY}:FaultyEnv", score_timeout_seconds=2.0, failure_reward=-1.0
    ):
        [prompt] = (await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=1), timeout=T)).prompts
        for bad in ("raise", "sleep", "nan", "crash"):
            scored = await stub.ScoreCompletions(group(prompt, prompt.reference_answer, bad), timeout=T)
            assert scored.skip_group, bad
            infos = list(scored.reward_infos)
            assert scored.failed_count == sum(not i.ok for i in infos) >= 1
            assert all(r == -1.0 for r, i in zip(scored.rewards, infos, strict=True) if not i.ok)
            assert all(i.failure for i in infos if not i.ok)
            check = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=T)
            assert check.status == health_pb2.HealthCheckResponse.SERVING
        good = await stub.ScoreCompletions(group(prompt, prompt.reference_answer), timeout=T)
        assert list(good.rewards) == [1.0] and not good.skip_group
        state = await stub.GetEnvironmentState(env_pb2.GetEnvironmentStateRequest(), timeout=T)
        m = state.metrics
        assert m["env/failures.exception"] == 2 and m["env/failures.timeout"] == 2
        assert m["env/failures.non_finite"] == 1 and m["env/failures.crash"] == 2
        assert m["env/groups_skipped"] == 4 and m["env/worker_restarts"] == 2


async def test_assign_value_policy() -> None:
    async for stub, _ in serve(
        spec=f"{FAULTY}:FaultyEnv", failure_policy="assign_value", failure_reward=0.25
    ):
        [prompt] = (await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=1), timeout=T)).prompts
        scored = await stub.ScoreCompletions(group(prompt, prompt.reference_answer, "nan"), timeout=T)
        assert list(scored.rewards) == [1.0, 0.25]
        assert not scored.skip_group and scored.failed_count == 1
        assert scored.reward_infos[1].details["failure_kind"] == "non_finite"


async def test_eval_serves_each_prompt_once_and_never_wraps() -> None:
    async for stub, _ in serve(spec="arithmetic", eval_size=64):
        with capture_logs() as logs:
            asked = env_pb2.SamplePromptsRequest(n=200, split=env_pb2.SPLIT_EVAL, start=0)
            served = await stub.SamplePrompts(asked, timeout=T)
        assert [p.id for p in served.prompts] == [f"arithmetic-eval-{i}" for i in range(64)]
        assert served.next_position == 64
        [warning] = [e for e in logs if e["log_level"] == "warning"]
        assert (warning["asked"], warning["served"], warning["eval_size"]) == (200, 64, 64)

        tail = await stub.SamplePrompts(
            env_pb2.SamplePromptsRequest(n=10, split=env_pb2.SPLIT_EVAL, start=60), timeout=T
        )
        assert [p.id for p in tail.prompts] == [f"arithmetic-eval-{i}" for i in range(60, 64)]
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the cursor is at the end: no wrap-around
            await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=1, split=env_pb2.SPLIT_EVAL), timeout=T)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "start=0" in err.value.details()

        state = await stub.GetEnvironmentState(env_pb2.GetEnvironmentStateRequest(), timeout=T)
        assert state.eval_position == 64 and state.metrics["env/prompts_sampled.eval"] == 68


async def test_finite_train_data_cycles_epochs_with_unique_ids(tmp_path: Path) -> None:
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(6)]
    data = tmp_path / "tiny.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    async for stub, _ in serve(spec="gsm8k", env_args={"path": str(data), "eval_size": 2}):
        first = await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=7), timeout=T)
        ids = [p.id for p in first.prompts]
        assert len(set(ids)) == 7 and [i.rsplit("@", 1)[1] for i in ids] == [str(i) for i in range(7)]
        base = [i.rsplit("@", 1)[0] for i in ids]
        assert len(set(base[:4])) == 4 and base[4] in base[:4]  # 4 train rows: the 5th prompt starts epoch 1
        resumed = await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=3, start=4), timeout=T)
        assert [p.id for p in resumed.prompts] == ids[4:7] and resumed.next_position == 7
