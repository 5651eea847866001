"""The arithmetic built-in: fixed prompt/answer format, determinism, exact-match and partial scoring."""

from __future__ import annotations

import random
import re

import pytest
from pydantic import ValidationError

from services.env.builtins.arithmetic import (
    ArithmeticEnv,
    ArithmeticOptions,
    make_problem,
    parse_answer,
    score_answer,
)
from services.env.cursor import PromptCursor
from services.env.loader import load_environment


def test_defaults_are_the_contract() -> None:
    o = ArithmeticOptions()
    assert (o.digits, o.terms, o.operators, o.partial_credit, o.seed, o.eval_size) == (
        2,
        2,
        "+-",
        False,
        0,
        200,
    )


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        (ArithmeticOptions(), r"^\d{1,2}[+-]\d{1,2}=$"),
        (ArithmeticOptions(digits=3, terms=4, operators="+-*"), r"^\d{1,3}([+*-]\d{1,3}){3}=$"),
    ],
)
def test_make_problem_format_and_answer(options: ArithmeticOptions, pattern: str) -> None:
    rng = random.Random(123)
    for _ in range(200):
        prompt, answer = make_problem(rng, options)
        assert re.match(pattern, prompt), prompt
        assert " " not in prompt
        assert re.fullmatch(r"-?\d+", answer)
        # Python's own evaluation of the expression (same precedence rules) is the oracle.
        assert int(answer) == eval(prompt[:-1])


def test_make_problem_is_deterministic_per_rng_seed() -> None:
    o = ArithmeticOptions()
    first = [make_problem(random.Random(7), o) for _ in range(3)]
    again = [make_problem(random.Random(7), o) for _ in range(3)]
    assert first == again
    assert make_problem(random.Random(7), o) != make_problem(random.Random(8), o)


def test_multiplication_precedence_hand_case() -> None:
    # Find a problem with '*' after '+' and check it against a hand evaluation.
    rng = random.Random(0)
    o = ArithmeticOptions(digits=1, terms=3, operators="+*")
    while True:
        prompt, answer = make_problem(rng, o)
        if re.fullmatch(r"\d\+\d\*\d=", prompt):
            a, b, c = int(prompt[0]), int(prompt[2]), int(prompt[4])
            assert int(answer) == a + b * c
            break


@pytest.mark.parametrize(
    ("completion", "answer", "reward", "parsed"),
    [
        ("82", "82", 1.0, "82"),
        ("  82\n", "82", 1.0, "82"),
        ("82 because 37+45", "82", 1.0, "82"),
        ("-8", "-8", 1.0, "-8"),
        ("8", "-8", 0.0, "8"),
        ("83", "82", 0.0, "83"),
        ("eighty-two", "82", 0.0, None),
        ("", "82", 0.0, None),
        ("x82", "82", 0.0, None),
    ],
)
def test_score_answer_exact(completion: str, answer: str, reward: float, parsed: str | None) -> None:
    assert score_answer(completion, answer) == (reward, parsed)


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("83", "82", 0.5),  # right-aligned: '8' matches, '3' vs '2' does not
        ("182", "82", 2 / 3),  # two of three characters line up
        ("82", "82", 1.0),
        ("8", "-8", 0.5),  # digit matches, sign missing
        ("abc", "82", 0.0),
    ],
)
def test_partial_credit(completion: str, answer: str, reward: float) -> None:
    assert score_answer(completion, answer, partial_credit=True)[0] == pytest.approx(reward)


def test_parse_answer() -> None:
    assert parse_answer(" -12abc") == "-12"
    assert parse_answer("- 12") is None


async def test_env_prompts_deterministic_and_splits_distinct() -> None:
    a, b = PromptCursor(load_environment("arithmetic")), PromptCursor(load_environment("arithmetic"))
    first = (await a.take(16, "train")).prompts
    assert [p.text for p in first] == [p.text for p in (await b.take(16, "train")).prompts]
    other_seed = (await PromptCursor(load_environment("arithmetic", {"seed": 1})).take(16, "train")).prompts
    assert [p.text for p in other_seed] != [p.text for p in first]
    evaluation = (await a.take(16, "eval")).prompts
    assert [p.text for p in evaluation] != [p.text for p in first]
    # Resumable: the cursor continues, and `start` replays from a position.
    second = (await a.take(4, "train")).prompts
    assert [p.id for p in second] == [f"arithmetic-train-{i}" for i in range(16, 20)]
    replay = (await b.take(4, "train", start=16)).prompts
    assert [p.text for p in replay] == [p.text for p in second]


async def test_env_reference_scores_one_and_wrong_answers_zero() -> None:
    env = load_environment("arithmetic", {"digits": 3, "operators": "+-*", "terms": 3})
    for prompt in (await PromptCursor(env).take(20, "train")).prompts:
        [ref] = await env.score(prompt, [env.reference_completion(prompt)])
        assert ref.reward == 1.0
        for score in await env.score(prompt, env.wrong_answers(prompt)):
            assert score.reward == 0.0


def test_options_validation() -> None:
    with pytest.raises(ValidationError, match="unsupported operator"):
        ArithmeticOptions(operators="+/")
    with pytest.raises(ValidationError):
        ArithmeticOptions(terms=1)
    assert ArithmeticEnv().split_size("eval") == 200
