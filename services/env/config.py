"""Environment settings: the recipe fields shared with `check-env`, and the service's own.

`EnvRecipeFields` says which environment and how it is scored (spec, options, reward functions, seed,
eval size, scoring deadline); it is defined once and used by both `EnvSettings` (the service: `[env]`
table, `GRPO_ENV__*` env vars, `python -m services.env --help`) and `check.CheckSettings`
(`grpo-mesh check-env --help`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings
from services.env.loader import EnvRecipe, parse_env_args


class EnvRecipeFields(BaseModel):
    """Which environment, its options and reward functions (an `EnvRecipe`), and its scoring deadline."""

    spec: str = Field(
        default="arithmetic",
        description="Environment: a built-in (arithmetic, gsm8k, reasoning_gym:<task>), "
        "package.module:Name or path/to/file.py:Name.",
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Environment options (validated by the env's own Options model), e.g. "
        '{"digits": 3}; in the run config a TOML table [env.env_args].',
    )
    env_arg: list[str] = Field(
        default_factory=list,
        description="One environment option as key=value (repeatable; the value is parsed as JSON if it "
        "is valid JSON); overrides env_args. Values with commas or JSON objects go in env_args.",
    )
    reward_funcs: list[str] = Field(
        default_factory=list,
        description="Extra TRL-style reward functions: built-ins (answer_tags, think_answer) or "
        "package.module:func / path/to/file.py:func. Their weighted sum is added to the env's reward.",
    )
    reward_weights: list[float] = Field(
        default_factory=list, description="Weights of reward_funcs (default 1.0 each)."
    )
    env_reward_weight: float = Field(
        default=1.0,
        description="Weight of the env's own reward when reward_funcs are given (0 = drop it).",
    )
    seed: int | None = Field(
        default=None, description="Overrides the env's `seed` option when set (prompt order and generation)."
    )
    eval_size: int | None = Field(
        default=None, ge=0, description="Overrides the env's `eval_size` option when set (held-out prompts)."
    )
    score_timeout_seconds: float = Field(
        default=30.0,
        gt=0,
        description="Deadline of one scoring call (one group); past it the worker is killed.",
    )

    @model_validator(mode="after")
    def _check_weights(self) -> EnvRecipeFields:
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"{len(self.reward_weights)} reward_weights for {len(self.reward_funcs)} reward_funcs"
            )
        return self

    def recipe(self) -> EnvRecipe:
        """The environment described (env_arg overrides env_args; seed/eval_size override both)."""
        common = {"seed": self.seed, "eval_size": self.eval_size}
        return EnvRecipe(
            spec=self.spec,
            env_args={**self.env_args, **parse_env_args(self.env_arg)},
            common_args={key: value for key, value in common.items() if value is not None},
            reward_funcs=tuple(self.reward_funcs),
            reward_weights=tuple(self.reward_weights),
            env_reward_weight=self.env_reward_weight,
        )


class EnvSettings(EnvRecipeFields, ServiceSettings):
    """Serve an environment: prompts (SamplePrompts) and isolated scoring (ScoreCompletions).

    Smoke-test an environment before training: grpo-mesh check-env ENV_SPEC [--n 8]
    [--env-arg k=v ...] (see `grpo-mesh check-env --help`).
    """

    config_table = "env"
    model_config = SettingsConfigDict(env_prefix="GRPO_ENV__")

    prompt_format: Literal["auto", "text", "chat"] = Field(
        default="auto",
        description="auto: as the env gives them; chat: wrap text prompts as one user message; "
        "text: serve chat prompts as plain 'role: content' text (for models without a chat template).",
    )
    score_workers: int = Field(default=2, ge=1, le=64, description="Scoring worker processes kept running.")
    max_score_workers: int = Field(
        default=8,
        ge=1,
        le=64,
        description="Spare scoring workers are started up to this many while calls wait for a free one "
        "(a hung reward function holds its worker until --score-timeout-seconds); spares stop when idle.",
    )
    spare_worker_after_seconds: float = Field(
        default=1.0, gt=0, description="Seconds a scoring call waits for a free worker before a spare starts."
    )
    worker_startup_timeout_seconds: float = Field(
        default=120.0, gt=0, description="How long a scoring worker may take to load the environment."
    )
    max_pending_scores: int = Field(
        default=256,
        ge=1,
        description="Scoring calls that may wait for a worker; beyond: RESOURCE_EXHAUSTED.",
    )
    max_completions_per_call: int = Field(
        default=4096,
        ge=1,
        description="Largest group ScoreCompletions accepts (INVALID_ARGUMENT beyond).",
    )
    max_prompts_per_call: int = Field(default=4096, ge=1, description="Largest n accepted by SamplePrompts.")
    failure_policy: Literal["skip_group", "assign_value"] = Field(
        default="skip_group",
        description="A group with a failed score: skip_group (response.skip_group=true; the scheduler drops "
        "it) or assign_value (failed completions get failure_reward).",
    )
    failure_reward: float = Field(default=0.0, description="Reward reported for a failed completion.")
    reward_min: float | None = Field(
        default=None, description="Rewards below this are failures (default: the env's declared range)."
    )
    reward_max: float | None = Field(
        default=None, description="Rewards above this are failures (default: the env's declared range)."
    )

    @model_validator(mode="after")
    def _check_reward_bounds(self) -> EnvSettings:
        if self.reward_min is not None and self.reward_max is not None and self.reward_min > self.reward_max:
            raise ValueError(f"reward_min {self.reward_min} > reward_max {self.reward_max}")
        return self
