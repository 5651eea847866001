"""The plug-in contract: typed options (new and old style), the default scorer's failure label."""

from __future__ import annotations

from typing import ClassVar, Generic, TypeVar

import pytest
from pydantic import BaseModel

from services.env.base import Environment, NoOptions, PromptItem, Score, failure
from services.env.builtins.arithmetic import ArithmeticEnv, ArithmeticOptions
from services.env.builtins.gsm8k import Gsm8kEnv, Gsm8kOptions
from services.env.builtins.reasoning_gym_env import ReasoningGymEnv, ReasoningGymOptions, task_environment

PROMPT = PromptItem(id="p", text="2+2=", reference_answer="4")


class Opts(BaseModel):
    level: int = 1


class Other(BaseModel):
    size: int = 2


class Typed(Environment[Opts]):
    name: ClassVar[str] = "typed"


class SubTyped(Typed):
    pass


class OldStyle(Environment):
    name: ClassVar[str] = "old"
    Options: ClassVar[type[BaseModel]] = Opts


class Explicit(Environment[Opts]):
    Options: ClassVar[type[BaseModel]] = Other  # an explicit Options wins over the type parameter


T = TypeVar("T", bound=BaseModel)


class GenericMiddle(Environment[T], Generic[T]):
    """A reusable base that leaves the options type open."""


class Leaf(GenericMiddle[Other]):
    pass


def test_options_come_from_the_type_parameter() -> None:
    assert Typed.Options is Opts
    env = Typed()
    assert isinstance(env.options, Opts) and env.options.level == 1
    assert Typed(Opts(level=3)).options.level == 3
    assert SubTyped.Options is Opts  # inherited by plain subclasses
    assert Leaf.Options is Other and GenericMiddle.Options is NoOptions
    assert Explicit.Options is Other


def test_old_style_options_still_work() -> None:
    assert OldStyle.Options is Opts and OldStyle().options.level == 1

    class Bare(Environment):
        pass

    assert Bare.Options is NoOptions and Bare().options_dict() == {}


def test_builtins_are_typed() -> None:
    assert ArithmeticEnv.Options is ArithmeticOptions
    assert Gsm8kEnv.Options is Gsm8kOptions
    assert ReasoningGymEnv.Options is ReasoningGymOptions
    assert ArithmeticEnv(ArithmeticOptions(digits=4)).options.digits == 4


def test_reasoning_gym_instances_are_named_by_task() -> None:
    env = task_environment("leg_counting")(ReasoningGymOptions(task="leg_counting"))
    assert env.name == "reasoning_gym:leg_counting" and isinstance(env, ReasoningGymEnv)
    assert task_environment("leg_counting") is type(env)
    assert ReasoningGymEnv.name == "reasoning_gym"


class Raising(Environment):
    def score_one(self, prompt: PromptItem, completion: str) -> Score | float | None:
        if completion == "bad":
            raise ValueError("cannot parse")
        return 1.0


async def test_score_one_exception_is_labelled_like_every_failure_kind() -> None:
    ok, bad = await Raising().score(PROMPT, ["4", "bad"])
    assert ok == 1.0
    assert isinstance(bad, Score) and bad.reward is None
    assert bad.failure == "exception: ValueError: cannot parse"
    assert bad.details == {"failure_kind": "exception"}
    assert bad == failure("exception", "ValueError: cannot parse")


async def test_missing_scorer_is_not_a_per_completion_failure() -> None:
    with pytest.raises(NotImplementedError, match="neither score_one nor score"):
        await Typed().score(PROMPT, ["4"])
    with pytest.raises(NotImplementedError, match="neither prompt_at nor sample"):
        Typed().prompt_at("train", 0)
