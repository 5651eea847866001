"""Loading environments by built-in name, import path and file path; options and their errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from services.env.base import GroupResult, Score
from services.env.builtins.arithmetic import ArithmeticEnv
from services.env.config import EnvSettings
from services.env.cursor import PromptCursor
from services.env.loader import EnvLoadError, EnvRecipe, load_environment, load_recipe, parse_env_args
from services.env.rewards import RewardFunctionScorer

CUSTOM_ENV = textwrap.dedent(
    """
    from typing import ClassVar
    from pydantic import BaseModel, ConfigDict
    from services.env.base import Environment, PromptItem, Score

    class WordOptions(BaseModel):
        model_config = ConfigDict(extra="forbid")
        word: str = "hello"
        seed: int = 0

    class EchoEnv(Environment):
        name: ClassVar[str] = "echo"
        Options: ClassVar[type[BaseModel]] = WordOptions

        def prompt_at(self, split, index):
            return PromptItem(id=f"echo-{index}", text=f"Repeat: {self.options.word} {index}",
                              reference_answer=f"{self.options.word} {index}")

        def score_one(self, prompt, completion):
            return Score(reward=float(completion.strip() == prompt.reference_answer),
                         parsed_answer=completion.strip())

    def not_an_env():
        return 42
    """
)


@pytest.fixture
def env_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_env.py"
    path.write_text(CUSTOM_ENV)
    return path


def test_parse_env_args() -> None:
    assert parse_env_args(["digits=3", "operators=+-*", "partial_credit=true", "name=a=b"]) == {
        "digits": 3,
        "operators": "+-*",
        "partial_credit": True,
        "name": "a=b",
    }
    with pytest.raises(EnvLoadError, match="expected key=value"):
        parse_env_args(["digits"])


def test_builtin_and_import_path() -> None:
    assert isinstance(load_environment("arithmetic"), ArithmeticEnv)
    env = load_environment("services.env.builtins.arithmetic:ArithmeticEnv", {"digits": 4})
    assert isinstance(env, ArithmeticEnv) and env.options.digits == 4


async def test_custom_env_from_file_path(env_file: Path) -> None:
    env = load_environment(f"{env_file}:EchoEnv", {"word": "bye"})
    [prompt] = (await PromptCursor(env).take(1, "train")).prompts
    assert prompt.text == "Repeat: bye 0"
    scores = await env.score(prompt, ["bye 0", "hello 0"])
    assert [s.reward for s in scores] == [1.0, 0.0]


@pytest.mark.parametrize(
    ("spec", "args", "message"),
    [
        ("arithmetic", {"digits": "many"}, r"digits: Input should be a valid integer.*got 'many'"),
        ("arithmetic", {"colour": "red"}, r"unknown option 'colour'[\s\S]*valid options: digits"),
        ("nonexistent", {}, "expected a built-in name"),
        ("no_such_pkg.mod:Env", {}, "cannot import module 'no_such_pkg.mod'"),
        ("services.env.builtins.arithmetic:Nope", {}, "has no attribute 'Nope'"),
        ("/does/not/exist.py:Env", {}, "environment file not found"),
    ],
)
def test_load_errors(spec: str, args: dict, message: str) -> None:
    with pytest.raises(EnvLoadError, match=message):
        load_environment(spec, args)


def test_file_errors(env_file: Path, tmp_path: Path) -> None:
    with pytest.raises(EnvLoadError, match=r"unknown option 'wrod'[\s\S]*valid options: word"):
        load_environment(f"{env_file}:EchoEnv", {"wrod": "x"})
    with pytest.raises(EnvLoadError, match="returned int, not an Environment"):
        load_environment(f"{env_file}:not_an_env")
    broken = tmp_path / "broken.py"
    broken.write_text("raise ImportError('missing dependency foo')\n")
    with pytest.raises(EnvLoadError, match="missing dependency foo"):
        load_environment(f"{broken}:Env")
    faulty = Path(__file__).parent / "faulty_envs.py"
    with pytest.raises(EnvLoadError, match="is a reward function, not an environment"):
        load_environment(f"{faulty}:length_reward")


def test_reward_funcs_compose_a_scorer_around_the_env() -> None:
    faulty = Path(__file__).parent / "faulty_envs.py"
    recipe = EnvRecipe(
        "arithmetic", reward_funcs=("answer_tags", f"{faulty}:length_reward"), reward_weights=(0.5, 2)
    )
    loaded = load_recipe(recipe)
    assert isinstance(loaded.env, ArithmeticEnv) and loaded.env.name == "arithmetic"
    assert isinstance(loaded.scorer, RewardFunctionScorer) and loaded.scorer.env is loaded.env
    assert loaded.scorer.weights == [0.5, 2.0] and loaded.scorer.env_weight == 1.0
    assert loaded.options_dict()["reward_funcs"] == ["answer_tags", "length_reward"]
    assert isinstance(load_environment(recipe), ArithmeticEnv)  # the environment alone
    plain = load_recipe(EnvRecipe("arithmetic"))
    assert plain.scorer is plain.env and plain.options_dict() == plain.env.options_dict()
    with pytest.raises(EnvLoadError, match="unknown reward function 'tags'"):
        load_recipe(EnvRecipe("arithmetic", reward_funcs=("tags",)))
    with pytest.raises(EnvLoadError, match="1 reward weights for 2 reward functions"):
        load_recipe(
            EnvRecipe("arithmetic", reward_funcs=("answer_tags", "think_answer"), reward_weights=(1,))
        )


def test_settings_recipe(tmp_path: Path, env_file: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[env]\nspec = "arithmetic"\nseed = 5\n[env.env_args]\ndigits = 3\nterms = 2\n')
    settings = EnvSettings.from_cli(["--config", str(config), "--env-arg", "terms=4"])
    recipe = settings.recipe()
    assert recipe.env_args == {"digits": 3, "terms": 4}
    env = load_environment(recipe)
    assert (env.options.digits, env.options.terms, env.options.seed) == (3, 4, 5)
    # Service-wide seed / eval_size apply only where the env has such an option (EchoEnv has no eval_size).
    echo = load_environment(EnvRecipe(f"{env_file}:EchoEnv", common_args={"seed": 3, "eval_size": 9}))
    assert echo.options.seed == 3
    with pytest.raises(ValueError, match="reward_weights"):
        EnvSettings(reward_funcs=["answer_tags"], reward_weights=[1.0, 2.0])


ROOT = Path(__file__).resolve().parents[2]


async def test_existing_env_files_load_and_work_unchanged() -> None:
    """examples/my_env.py and faulty_envs.py are in the old plug-in style (ClassVar Options, no parameter)."""
    example = load_recipe(
        EnvRecipe(
            f"{ROOT}/examples/my_env.py:CountLettersEnv",
            env_args={"letter": "s", "words": 3},
            reward_funcs=(f"{ROOT}/examples/my_env.py:brevity",),
            reward_weights=(0.5,),
        )
    )
    env = example.env
    assert type(env).__name__ == "CountLettersEnv" and type(env).Options.__name__ == "CountLettersOptions"
    assert (env.options.words, env.split_size("train"), env.split_size("eval")) == (3, 0, 50)
    cursor = PromptCursor(env)
    prompts = (await cursor.take(4, "train")).prompts + (await cursor.take(2, "eval")).prompts
    assert [p.id for p in prompts[-2:]] == ["count_letters-eval-0", "count_letters-eval-1"]
    for prompt in prompts:
        [ref, *wrong] = await env.score(
            prompt, [env.reference_completion(prompt), *env.wrong_answers(prompt)]
        )
        assert ref.reward == 1.0 and [w.reward for w in wrong] == [0.0, 0.0]
        combined = await example.scorer.score(prompt, [prompt.reference_answer, "I think it is many."])
        assert [s.reward for s in combined] == [1.5, 0.0]  # env 1 + 0.5 × brevity 1; env 0 + 0.5 × 0
    assert env.evaluate([GroupResult(prompts[0], ["3"], [Score(1.0, parsed_answer="3")])]) == {
        "answered_rate": 1.0
    }

    faulty = load_environment(f"{ROOT}/tests/env/faulty_envs.py:FaultyEnv")
    assert type(faulty).Options.__name__ == "FaultyOptions" and faulty.split_size("eval") == 4
    [prompt] = (await PromptCursor(faulty).take(1, "train")).prompts
    assert prompt.id == "faulty-train-0"
    assert await faulty.score(prompt, ["0", "1", "nan"]) == [
        1.0,
        0.0,
        pytest.approx(float("nan"), nan_ok=True),
    ]
