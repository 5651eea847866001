"""The `guessing` built-in: a hidden number per prompt, Higher/Lower feedback turns, reward for finding it
within max_turns (optionally discounted per extra turn)."""

from __future__ import annotations

import asyncio

import pytest

from services.env.base import Message, Score
from services.env.builtins.guessing import GuessingEnv, binary_search, guess_of
from services.env.loader import EnvLoadError, load_environment


def _env(**options: object) -> GuessingEnv:
    env = load_environment("guessing", dict(options))
    assert isinstance(env, GuessingEnv)
    return env


def _turns(*texts: str) -> list[Message]:
    return [{"role": "assistant", "content": text} for text in texts]


def _rewards(env: GuessingEnv, item: object, episodes: list[list[Message]]) -> list[float | None]:
    scores = asyncio.run(env.score_episodes(item, episodes))  # type: ignore[arg-type]
    return [s.reward if isinstance(s, Score) else None for s in scores]


def test_prompts_are_deterministic_and_in_range() -> None:
    env, again = _env(), _env()
    items = [env.prompt_at("train", i) for i in range(64)]
    assert items == [again.prompt_at("train", i) for i in range(64)]
    targets = [int(item.metadata["target"]) for item in items]
    assert all(1 <= t <= 8 for t in targets) and len(set(targets)) > 4
    assert all(item.reference_answer == item.metadata["target"] for item in items)
    assert "between 1 and 8" in items[0].messages[-1]["content"]
    assert targets != [int(_env(seed=1).prompt_at("train", i).metadata["target"]) for i in range(64)]
    assert env.turn_limit == 4 and env.split_size("eval") == 200


def test_respond_gives_feedback_and_ends_on_the_number() -> None:
    env = _env(high=16)
    item = env.prompt_at("train", 0)
    target = int(item.metadata["target"])

    def reply_to(*texts: str) -> tuple[bool, list[Message]]:
        reply = asyncio.run(env.respond(item, _turns(*texts)))
        return reply.done, reply.messages

    if target > 1:
        assert reply_to(f"Is it {target - 1}?") == (False, [{"role": "user", "content": "Higher."}])
    if target < 16:
        assert reply_to("1", str(target + 1)) == (False, [{"role": "user", "content": "Lower."}])
    assert reply_to("Hmm, no idea") == (
        False,
        [{"role": "user", "content": "Please guess a whole number between 1 and 16."}],
    )
    assert reply_to(f"My guess is {target}.") == (True, [])
    assert reply_to("99", str(target)) == (True, [])


def test_scoring_within_max_turns_and_discount() -> None:
    env = _env(max_turns=3)
    item = env.prompt_at("train", 2)
    target = int(item.metadata["target"])
    wrong = str(target % 8 + 1)
    episodes = [
        _turns(str(target)),
        _turns(wrong, wrong, str(target)),
        _turns(wrong, wrong, wrong, str(target)),
    ]
    assert _rewards(env, item, [*episodes, _turns("no idea"), []]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    discounted = _env(max_turns=3, discount=0.5)
    assert _rewards(discounted, item, [_turns(str(target)), _turns(wrong, str(target)), episodes[1]]) == [
        1.0,
        0.75,
        0.5,
    ]
    assert discounted.success_threshold == 0.5  # every success stays at or above it
    assert env.score_one(item, f"I guess {target}").reward == 1.0


def test_binary_search_finds_every_number_within_the_default_budget() -> None:
    for target in range(1, 9):
        guesses = binary_search(8, target)
        assert guesses[-1] == target and len(guesses) <= 4 and target not in guesses[:-1]
    assert guess_of("between 3 and 5") == 5 and guess_of("none") is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"high": 1}, "high: Input should be greater than or equal to 2"),
        ({"discount": 0.6}, "discount: Input should be less than or equal to 0.5"),
        ({"max_turns": 0}, "max_turns: Input should be greater than or equal to 1"),
        ({"question": "Pick {low}..{high}"}, "question may only use the placeholder {high}"),
        ({"target": 3}, "unknown option 'target'"),
    ],
)
def test_bad_options_are_rejected(options: dict[str, object], message: str) -> None:
    with pytest.raises(EnvLoadError, match="valid options") as caught:
        _env(**options)
    assert message in str(caught.value)
