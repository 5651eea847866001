"""Loading environments by built-in name, import path and file path; options and their errors."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from services.env.builtins.arithmetic import ArithmeticEnv
from services.env.config import EnvSettings
from services.env.loader import EnvLoadError, EnvRecipe, load_environment, parse_env_args
from services.env.rewards import RewardFunctionEnvironment

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
    [prompt] = await env.sample(1)
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


def test_reward_funcs_wrap_the_env() -> None:
    faulty = Path(__file__).parent / "faulty_envs.py"
    recipe = EnvRecipe(
        "arithmetic", reward_funcs=("answer_tags", f"{faulty}:length_reward"), reward_weights=(0.5, 2)
    )
    env = load_environment(recipe)
    assert isinstance(env, RewardFunctionEnvironment) and env.name == "arithmetic"
    with pytest.raises(EnvLoadError, match="unknown reward function 'tags'"):
        load_environment(EnvRecipe("arithmetic", reward_funcs=("tags",)))
    with pytest.raises(EnvLoadError, match="1 reward weights for 2 reward functions"):
        load_environment(
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
