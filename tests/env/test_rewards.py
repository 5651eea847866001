"""TRL-style reward functions: call convention, weighted combination, None and failures, format rewards."""

from __future__ import annotations

import math

import pytest

from services.env.base import PromptItem, Score
from services.env.builtins.arithmetic import ArithmeticEnv
from services.env.rewards import (
    RewardFunctionScorer,
    answer_tags,
    call_reward_func,
    combine,
    think_answer,
)

TEXT = PromptItem(id="p", text="2+2=", reference_answer="4", metadata={"level": "easy"})
CHAT = PromptItem(id="c", messages=({"role": "user", "content": "2+2?"},), reference_answer="4")


def test_call_convention_text_and_chat() -> None:
    seen: dict = {}

    def spy(prompts, completions, **columns):
        seen.update(prompts=prompts, completions=completions, columns=columns)
        return [1.0] * len(completions)

    assert call_reward_func(spy, TEXT, ["4", "5"]) == [1.0, 1.0]
    assert seen["prompts"] == ["2+2=", "2+2="]
    assert seen["completions"] == ["4", "5"]
    assert seen["columns"] == {"level": ["easy"] * 2, "answer": ["4"] * 2, "reference_answer": ["4"] * 2}
    call_reward_func(spy, CHAT, ["4"])
    assert seen["prompts"] == [[{"role": "user", "content": "2+2?"}]]
    assert seen["completions"] == [[{"role": "assistant", "content": "4"}]]


def test_call_checks_length() -> None:
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        call_reward_func(lambda prompts, completions, **_: [1.0], TEXT, ["a", "b"])


def test_format_rewards() -> None:
    texts = [
        "<answer>4</answer>",
        "<think>x</think>\n<answer>4</answer>",
        "4",
        "<answer>1</answer><answer>2</answer>",
    ]
    assert answer_tags([], texts) == [1.0, 1.0, 0.0, 0.0]
    assert think_answer([], texts) == [0.0, 1.0, 0.0, 0.0]
    assert answer_tags([], [[{"role": "assistant", "content": "<answer>4</answer>"}]]) == [1.0]


def test_combine_weights_none_and_failures() -> None:
    parts = [
        ("a", 1.0, [Score(1.0), Score(0.0), Score(None), Score(None)]),
        ("b", 0.5, [Score(1.0), Score(None), Score(None), Score(None, failure="boom")]),
    ]
    a0, a1, a2, a3 = combine(parts, 4)
    assert a0.reward == 1.5 and a0.details["reward.b"] == "1.0"
    assert a1.reward == 0.0
    assert a2.reward is None and a2.failure == "no reward function applied"
    assert a3.reward is None and a3.failure == "b: boom"


async def test_env_plus_format_reward() -> None:
    env = ArithmeticEnv()
    scorer = RewardFunctionScorer(env, [answer_tags], [0.5], env_weight=1.0)
    assert scorer.reward_range == (0.0, 1.5)
    assert scorer.success_threshold == 1.5
    prompt = env.prompt_at("train", 0)
    answer = prompt.reference_answer
    scores = await scorer.score(prompt, [f"<answer>{answer}</answer>", answer, "<answer>nope</answer>"])
    # The env scores the content of the answer tags; the format reward adds its weight.
    assert [s.reward for s in scores] == [1.5, 1.0, 0.5]
    assert (
        scores[0].details["reward.arithmetic"] == "1.0" and scores[0].details["reward.answer_tags"] == "1.0"
    )
    assert scorer.reference_completion(prompt) == f"<answer>{answer}</answer>"
    assert scorer.wrong_answers(prompt) == env.wrong_answers(prompt)
    assert scorer.options_dict() == {
        **env.options_dict(),
        "reward_funcs": ["answer_tags"],
        "reward_weights": [0.5],
        "env_reward_weight": 1.0,
    }


async def test_think_answer_reference_and_threshold() -> None:
    env = ArithmeticEnv()
    scorer = RewardFunctionScorer(env, [think_answer, answer_tags], [1.0, 0.0], env_weight=2.0)
    assert scorer.success_threshold == 3.0 and scorer.reward_range == (0.0, 3.0)
    prompt = env.prompt_at("eval", 3)
    reference = scorer.reference_completion(prompt)
    assert reference == f"<think>Working it out.</think>\n<answer>{prompt.reference_answer}</answer>"
    assert [s.reward for s in await scorer.score(prompt, [reference])] == [3.0]


async def test_env_scorer_setup_only_when_its_reward_counts() -> None:
    class Counting(ArithmeticEnv):
        setups = 0

        def setup_scorer(self) -> None:
            type(self).setups += 1

    RewardFunctionScorer(Counting(), [answer_tags]).setup_scorer()
    assert Counting.setups == 0
    RewardFunctionScorer(Counting(), [answer_tags], env_weight=1.0).setup_scorer()
    assert Counting.setups == 1


async def test_functions_only_and_validation() -> None:
    def exact(prompts, completions, answer, **_):
        return [float(c == a) if c else None for c, a in zip(completions, answer, strict=True)]

    scorer = RewardFunctionScorer(ArithmeticEnv(), [exact])
    prompt = ArithmeticEnv().prompt_at("train", 0)
    scores = await scorer.score(prompt, [prompt.reference_answer, "0", ""])
    assert [s.reward for s in scores[:2]] == [1.0, 0.0]
    assert scores[2].failure == "no reward function applied"
    with pytest.raises(ValueError, match="nothing to score with"):
        RewardFunctionScorer(ArithmeticEnv(), [])
    with pytest.raises(ValueError, match="2 reward weights for 1 reward functions"):
        RewardFunctionScorer(ArithmeticEnv(), [exact], [1.0, 2.0])
    assert math.isinf(scorer.reward_range[1])
