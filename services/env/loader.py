"""Turn an environment spec plus options into an `Environment` (and its scorer).

Specs:
* a built-in name: `arithmetic`, `gsm8k`, `tool_arithmetic`, `guessing`, `reasoning_gym:<task>` (e.g.
  `reasoning_gym:basic_arithmetic`);
* an import path: `package.module:Name`;
* a file path: `path/to/my_env.py:Name`.

`Name` may be an `Environment` subclass (instantiated with its validated options), an `Environment`
instance, or a zero-argument factory returning one. Options come from the run config (`env_args`) and
`--env-arg key=value` (the value is parsed as JSON when it is valid JSON, else kept as a string); they
are validated by the environment's own pydantic `Options` model and every problem is reported at once.

`load_recipe` builds what the service needs, a `LoadedEnv`: the environment (always the prompt
source) and its scorer, which is the environment itself or, with reward functions (`reward_funcs`:
built-in names such as `answer_tags`, or import/file paths of TRL-style functions), a
`RewardFunctionScorer` around it. `load_environment` builds the environment alone.

`EnvRecipe` is the picklable description of all this: scoring worker processes rebuild the same
scorer from it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from services.common.errors import InvalidArgument
from services.env.base import Environment, Scorer
from services.env.rewards import BUILTIN_REWARDS, RewardFunc, RewardFunctionScorer


class EnvLoadError(InvalidArgument):
    """The environment spec or its options are wrong; the message says what and how to fix it."""


@dataclass(frozen=True)
class EnvRecipe:
    """Everything needed to (re)build an environment, in any process."""

    spec: str = "arithmetic"
    env_args: dict[str, Any] = field(default_factory=dict)
    reward_funcs: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    env_reward_weight: float = 1.0
    # Service-wide overrides (seed, eval_size), applied only where the env's Options has the field.
    common_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LoadedEnv:
    """What a recipe builds: the environment (prompt source, hooks) and what scores its completions."""

    env: Environment[Any]
    scorer: Scorer  # `env` itself, or a RewardFunctionScorer around it

    def options_dict(self) -> dict[str, Any]:
        """The resolved options (the env's, plus the reward functions when there are any)."""
        return self.scorer.options_dict()


def _builtin(spec: str) -> tuple[type[Environment[Any]], dict[str, Any]] | None:
    """The class and preset options of a built-in spec, or None if `spec` is not a built-in name."""
    if spec == "arithmetic":
        from services.env.builtins.arithmetic import ArithmeticEnv

        return ArithmeticEnv, {}
    if spec == "gsm8k":
        from services.env.builtins.gsm8k import Gsm8kEnv

        return Gsm8kEnv, {}
    if spec == "tool_arithmetic":
        from services.env.builtins.tool_arithmetic import ToolArithmeticEnv

        return ToolArithmeticEnv, {}
    if spec == "guessing":
        from services.env.builtins.guessing import GuessingEnv

        return GuessingEnv, {}
    if spec == "reasoning_gym" or spec.startswith("reasoning_gym:"):
        from services.env.builtins.reasoning_gym_env import task_environment

        task = spec.partition(":")[2]
        if not task:
            raise EnvLoadError(
                "reasoning_gym needs a task: use reasoning_gym:<task>, e.g. reasoning_gym:leg_counting"
            )
        return task_environment(task), {"task": task}
    return None


def _load_file_module(path: Path) -> Any:
    """Import a .py file under a stable synthetic module name (same name in every process)."""
    resolved = path.resolve()
    if not resolved.is_file():
        raise EnvLoadError(f"environment file not found: {path}")
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:10]
    module_name = f"grpo_user_env_{resolved.stem}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise EnvLoadError(f"cannot import {path}: not a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise EnvLoadError(f"importing {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def resolve_object(spec: str) -> Any:
    """The object named by `package.module:Name` or `path/to/file.py:Name`."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise EnvLoadError(
            f"cannot resolve {spec!r}: expected a built-in name, package.module:Name or path/to/file.py:Name"
        )
    if target.endswith(".py") or "/" in target:
        module = _load_file_module(Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise EnvLoadError(f"cannot import module {target!r} (from {spec!r}): {exc}") from exc
        except Exception as exc:
            raise EnvLoadError(f"importing {target!r} failed: {type(exc).__name__}: {exc}") from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise EnvLoadError(f"{target!r} has no attribute {attr!r}; it defines: {', '.join(public)}") from None


def parse_env_args(items: Iterable[str]) -> dict[str, Any]:
    """`["digits=3", "operators=+-*"]` → `{"digits": 3, "operators": "+-*"}` (JSON values when valid)."""
    result: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise EnvLoadError(f"bad --env-arg {item!r}: expected key=value")
        try:
            result[key] = json.loads(raw)
        except json.JSONDecodeError:
            result[key] = raw
    return result


def format_validation_error(env_name: str, model: type[BaseModel], exc: ValidationError) -> str:
    """One readable line per problem, plus the valid option names."""
    lines = [f"invalid options for environment {env_name!r}:"]
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "(options)"
        if error["type"] == "extra_forbidden":
            lines.append(f"  - unknown option {where!r}")
        else:
            lines.append(f"  - {where}: {error['msg']} (got {error.get('input')!r})")
    fields = [f"{name} (default {info.default!r})" for name, info in model.model_fields.items()]
    lines.append(f"  valid options: {', '.join(fields) if fields else 'none'}")
    return "\n".join(lines)


def validate_options(cls: type[Environment[Any]], args: dict[str, Any]) -> BaseModel:
    try:
        return cls.Options.model_validate(args)
    except ValidationError as exc:
        raise EnvLoadError(format_validation_error(cls.name, cls.Options, exc)) from None


def _construct(
    spec: str, cls: type[Environment[Any]], args: dict[str, Any], common: dict[str, Any] | None = None
) -> Environment[Any]:
    known = {key: value for key, value in (common or {}).items() if key in cls.Options.model_fields}
    options = validate_options(cls, {**args, **known})
    try:
        return cls(options)
    except EnvLoadError:
        raise
    except Exception as exc:
        raise EnvLoadError(f"creating environment {spec!r} failed: {type(exc).__name__}: {exc}") from exc


def _instantiate(spec: str, args: dict[str, Any], common: dict[str, Any] | None = None) -> Environment[Any]:
    builtin = _builtin(spec)
    if builtin is not None:
        cls, preset = builtin
        return _construct(spec, cls, {**preset, **args}, common)
    obj = resolve_object(spec)
    if inspect.isclass(obj) and issubclass(obj, Environment):
        return _construct(spec, obj, args, common)
    if isinstance(obj, Environment):
        if args:
            raise EnvLoadError(
                f"{spec!r} is an Environment instance; it takes no env args (got {sorted(args)})"
            )
        return obj
    if callable(obj):
        params = inspect.signature(obj).parameters
        if "completions" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise EnvLoadError(
                f"{spec!r} is a reward function, not an environment: give a prompt source as the spec "
                f"(e.g. arithmetic) and pass it with --reward-funcs {spec}"
            )
        env = obj()
        if isinstance(env, Environment):
            return env
        raise EnvLoadError(f"factory {spec!r} returned {type(env).__name__}, not an Environment")
    raise EnvLoadError(
        f"{spec!r} is a {type(obj).__name__}, not an Environment subclass, instance or factory"
    )


def resolve_reward_func(spec: str) -> RewardFunc:
    """A reward function from a built-in name (answer_tags, think_answer) or an import/file path."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise EnvLoadError(
            f"unknown reward function {spec!r}; built-ins: {', '.join(sorted(BUILTIN_REWARDS))}"
        )
    func = resolve_object(spec)
    if not callable(func) or inspect.isclass(func):
        raise EnvLoadError(f"reward function {spec!r} is not a function")
    return func


def load_environment(recipe: EnvRecipe | str, env_args: dict[str, Any] | None = None) -> Environment[Any]:
    """The environment alone (`load_recipe` adds a recipe's reward functions). Raises EnvLoadError."""
    if isinstance(recipe, str):
        recipe = EnvRecipe(spec=recipe, env_args=dict(env_args or {}))
    return _instantiate(recipe.spec, dict(recipe.env_args), recipe.common_args)


def load_recipe(recipe: EnvRecipe) -> LoadedEnv:
    """The environment a recipe describes and its scorer (with the reward functions). Raises EnvLoadError."""
    env = load_environment(recipe)
    if not recipe.reward_funcs:
        return LoadedEnv(env=env, scorer=env)
    funcs: list[Callable[..., Any]] = [resolve_reward_func(s) for s in recipe.reward_funcs]
    weights = list(recipe.reward_weights) or [1.0] * len(funcs)
    try:
        scorer = RewardFunctionScorer(env, funcs, weights, env_weight=recipe.env_reward_weight)
    except ValueError as exc:
        raise EnvLoadError(str(exc)) from None
    return LoadedEnv(env=env, scorer=scorer)
