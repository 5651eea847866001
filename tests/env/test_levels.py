"""Difficulty levels: the arithmetic env's digit-count levels through the cursor, and the contract over
a real gRPC server (levels described, a level's own stream, the level on every prompt, bad levels
refused with INVALID_ARGUMENT)."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from grpo.env.v1 import env_pb2
from services.env.builtins.arithmetic import ArithmeticEnv, ArithmeticOptions
from services.env.cursor import PromptCursor, interleaved

from .test_grpc import T, serve

LEVELED = {"digits": 4, "levels": "1-4"}


def _operands(text: str) -> list[str]:
    return [t for t in text.rstrip("=").replace("-", "+").split("+") if t]


async def test_each_level_draws_operands_of_its_digit_count_and_the_train_stream_interleaves_them() -> None:
    env = ArithmeticEnv(ArithmeticOptions(**LEVELED))
    assert env.levels() == ["1", "2", "3", "4"] and env.options.levels == "1,2,3,4"
    cursor = PromptCursor(env)
    mixed = (await cursor.take(8, "train")).prompts
    assert [p.metadata["level"] for p in mixed] == ["1", "2", "3", "4"] * 2  # uniform, round-robin
    for p in mixed:
        assert all(len(o) <= int(p.metadata["level"]) for o in _operands(p.text))
    threes = (await cursor.take(3, "train", start=1, level="3")).prompts
    assert [p.metadata["level"] for p in threes] == ["3"] * 3
    assert threes[0].text == mixed[interleaved(env.levels(), "3", 1)].text  # one position space
    assert cursor.level_positions() == {"3": 4} and cursor.positions()["train"] == 8
    held_out = (await cursor.take(20, "eval")).prompts  # the eval split stays the `digits` option
    assert any(len(o) == 4 for p in held_out for o in _operands(p.text))
    assert "level" not in held_out[0].metadata


async def test_without_levels_nothing_changes() -> None:
    env = ArithmeticEnv(ArithmeticOptions())
    assert env.levels() == []
    prompts = (await PromptCursor(env).take(3, "train")).prompts
    assert [p.id for p in prompts] == ["arithmetic-train-0", "arithmetic-train-1", "arithmetic-train-2"]
    assert all("level" not in p.metadata for p in prompts)


@pytest.mark.parametrize("levels", ["0", "1,1", "a", "4-", "1-10"])
def test_bad_levels_options_are_refused(levels: str) -> None:
    with pytest.raises(ValidationError, match="levels"):
        ArithmeticOptions(levels=levels)


async def test_levels_over_grpc() -> None:
    async for stub, _ in serve(spec="arithmetic", env_args=LEVELED):
        d = await stub.DescribeEnvironment(env_pb2.DescribeEnvironmentRequest(), timeout=T)
        assert list(d.levels) == ["1", "2", "3", "4"]
        drawn = await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=3, level="2", start=5), timeout=T)
        assert drawn.next_position == 8 and [p.metadata["level"] for p in drawn.prompts] == ["2"] * 3
        mixed = await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=4), timeout=T)
        assert [p.metadata["level"] for p in mixed.prompts] == ["1", "2", "3", "4"]
        state = await stub.GetEnvironmentState(env_pb2.GetEnvironmentStateRequest(), timeout=T)
        assert dict(state.level_positions) == {"2": 8} and state.train_position == 4
        for request, message in [
            (env_pb2.SamplePromptsRequest(n=1, level="5"), "unknown level '5'"),
            (env_pb2.SamplePromptsRequest(n=1, level="2", split=env_pb2.SPLIT_EVAL), "train stream"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.SamplePrompts(request, timeout=T)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.value.details()


async def test_a_level_on_an_env_without_levels_is_invalid_argument() -> None:
    async for stub, _ in serve(spec="arithmetic"):
        d = await stub.DescribeEnvironment(env_pb2.DescribeEnvironmentRequest(), timeout=T)
        assert list(d.levels) == []
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.SamplePrompts(env_pb2.SamplePromptsRequest(n=1, level="1"), timeout=T)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "declares no levels" in error.value.details()
