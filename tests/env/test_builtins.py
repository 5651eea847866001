"""gsm8k (from a local file) and reasoning_gym built-ins: determinism, reference = 1, wrong = 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.env.base import PromptItem, SplitName
from services.env.builtins.gsm8k import gold_answer, score_gsm8k
from services.env.cursor import PromptCursor
from services.env.loader import EnvLoadError, load_environment

ROWS = [
    {
        "question": f"Tom has {i} apples and buys {i + 3} more. How many apples?",
        "answer": f"{i}+{i + 3}=#### {2 * i + 3}",
    }
    for i in range(30)
] + [{"question": "A shop sells 1,000 pens a day for 2 days.", "answer": "1000*2=2000\n#### 2,000"}]


async def take(
    cursor: PromptCursor, n: int, split: SplitName = "train", start: int | None = None
) -> list[PromptItem]:
    return (await cursor.take(n, split, start)).prompts


@pytest.fixture
def gsm8k_file(tmp_path: Path) -> Path:
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return path


def test_gold_answer() -> None:
    assert gold_answer("She has 3 + 4 = 7 apples.\n#### 7") == "7"
    assert gold_answer("#### 2,000") == "2000"
    with pytest.raises(ValueError, match="####"):
        gold_answer("no marker")


@pytest.mark.parametrize(
    ("completion", "gold", "reward", "method"),
    [
        ("Step by step... #### 72", "72", 1.0, "math_verify"),
        ("The answer is 72.", "72", 1.0, "math_verify"),
        ("\\boxed{72}", "72", 1.0, "math_verify"),
        ("#### 1,234", "1234", 1.0, "math_verify"),
        ("#### 71", "72", 0.0, "math_verify"),
        ("I give up", "72", 0.0, "no_number"),
    ],
)
def test_score_gsm8k(completion: str, gold: str, reward: float, method: str) -> None:
    got_reward, _, got_method = score_gsm8k(completion, gold)
    assert (got_reward, got_method) == (reward, method)


async def test_gsm8k_local_file(gsm8k_file: Path) -> None:
    args = {"path": str(gsm8k_file), "eval_size": 5}
    env, same = load_environment("gsm8k", args), load_environment("gsm8k", args)
    await env.setup()
    await same.setup()
    assert (env.split_size("train"), env.split_size("eval")) == (26, 5)
    cursor = PromptCursor(env)
    train = await take(cursor, 10, "train")
    assert [p.messages for p in train] == [p.messages for p in await take(PromptCursor(same), 10, "train")]
    assert train[0].is_chat and train[0].messages[-1]["role"] == "user"
    eval_questions = {p.messages[-1]["content"] for p in await take(cursor, 5, "eval")}
    train_questions = {p.messages[-1]["content"] for p in await take(cursor, 26, "train", start=0)}
    assert not eval_questions & train_questions
    for prompt in train:
        [ref, *wrong] = await env.score(
            prompt, [env.reference_completion(prompt), *env.wrong_answers(prompt)]
        )
        assert ref.reward == 1.0
        assert [w.reward for w in wrong] == [0.0] * len(wrong)


async def test_gsm8k_plain_text_and_errors(gsm8k_file: Path, tmp_path: Path) -> None:
    env = load_environment("gsm8k", {"path": str(gsm8k_file), "chat": False})
    await env.setup()
    [prompt] = await take(PromptCursor(env), 1)
    assert prompt.text.endswith('output the final answer after "####".') and not prompt.messages
    missing = load_environment("gsm8k", {"path": str(tmp_path / "nope.jsonl")})
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        await missing.setup()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": "x", "answer": "#### 1"}) + "\n")
    with pytest.raises(ValueError, match="lacks field"):
        await load_environment("gsm8k", {"path": str(bad)}).setup()


async def test_reasoning_gym_task() -> None:
    env = load_environment("reasoning_gym:leg_counting", {"size": 50, "eval_size": 5})
    same = load_environment("reasoning_gym:leg_counting", {"size": 50, "eval_size": 5})
    assert env.name == "reasoning_gym:leg_counting"
    await env.setup()
    await same.setup()
    prompts = await take(PromptCursor(env), 6)
    assert [p.messages for p in prompts] == [p.messages for p in await take(PromptCursor(same), 6)]
    assert prompts[0].messages[0]["role"] == "system"
    for prompt in prompts:
        scores = await env.score(prompt, [env.reference_completion(prompt), *env.wrong_answers(prompt)])
        assert [s.reward for s in scores] == [1.0, 0.0, 0.0]
    # Answers without tags are scored from the whole (stripped) completion.
    assert (await env.score(prompts[0], [f"  {prompts[0].reference_answer}\n"]))[0].reward == 1.0


def test_reasoning_gym_errors() -> None:
    with pytest.raises(EnvLoadError, match="unknown reasoning_gym task 'no_such_task'"):
        load_environment("reasoning_gym:no_such_task")
    with pytest.raises(EnvLoadError, match="needs a task"):
        load_environment("reasoning_gym")


async def test_gsm8k_parquet_file_matches_jsonl(gsm8k_file: Path, tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    from_jsonl = load_environment("gsm8k", {"path": str(gsm8k_file), "eval_size": 5})
    from_parquet = load_environment("gsm8k", {"path": str(parquet), "eval_size": 5})
    await from_jsonl.setup()
    await from_parquet.setup()
    got = [(p.messages, p.reference_answer) for p in await take(PromptCursor(from_parquet), 8)]
    assert got == [(p.messages, p.reference_answer) for p in await take(PromptCursor(from_jsonl), 8)]


async def test_gsm8k_levels_by_solution_length(tmp_path: Path) -> None:
    from services.env.builtins.gsm8k import length_levels, solution_steps

    assert solution_steps("a = 1\n\nb = 2\n#### 3") == 2 and solution_steps("#### 3") == 0
    assert length_levels(["x\ny\n#### 1", "#### 1", "x\n#### 1", "#### 2"], 2) == [[1, 3], [2, 0]]
    rows = [
        {"question": f"q{i}", "answer": "".join(f"step {k}\n" for k in range(i % 5)) + f"#### {i}"}
        for i in range(40)
    ]
    path = tmp_path / "levels.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    env = load_environment("gsm8k", {"path": str(path), "eval_size": 5, "levels": 3})
    await env.setup()
    assert env.levels() == ["1", "2", "3"]
    assert sum(env.level_size(level) for level in env.levels()) == env.split_size("train") == 35
    cursor = PromptCursor(env)
    steps = {}
    for level in env.levels():
        drawn = (await cursor.take(env.level_size(level), "train", level=level)).prompts
        assert {p.metadata["level"] for p in drawn} == {level}
        lengths = [int(p.reference_answer) % 5 for p in drawn]  # row i has i % 5 steps
        steps[level] = (min(lengths), max(lengths))
    assert steps["1"][1] <= steps["2"][0] and steps["2"][1] <= steps["3"][0], steps  # shortest first
    with pytest.raises(EnvLoadError, match="less than or equal to 20"):
        load_environment("gsm8k", {"path": str(path), "levels": 21})
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(json.dumps(r) for r in rows[:10]) + "\n")
    too_many = load_environment("gsm8k", {"path": str(small), "eval_size": 5, "levels": 6})
    with pytest.raises(ValueError, match="levels=6 needs at least 6 train rows, got 5"):
        await too_many.setup()
