"""Deliberately misbehaving environments and reward functions, loaded by file path in the tests.

`FaultyEnv` scores a group by looking at the completion texts: "raise" makes the whole call raise,
"sleep" makes it hang far past any test timeout, "crash" kills the worker process, "nan" and
"huge" give that completion a non-finite / out-of-range reward, "none" returns None, "short"
returns one score too few; any other text scores 1.0 if it equals the reference answer, else 0.0.
"""

from __future__ import annotations

import math
import os
import time
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from services.env.base import Environment, PromptItem, SplitName


class FaultyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: int = Field(default=0)
    eval_size: int = Field(default=4)


class FaultyEnv(Environment):
    name: ClassVar[str] = "faulty"
    description: ClassVar[str] = "misbehaves on request"
    Options: ClassVar[type[BaseModel]] = FaultyOptions
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def split_size(self, split: SplitName) -> int:
        return 0 if split == "train" else self.options.eval_size

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        return PromptItem(id=f"faulty-{split}-{index}", text=f"say {index}", reference_answer=str(index))

    async def score(self, prompt, completions):
        texts = list(completions)
        if "raise" in texts:
            raise RuntimeError("scorer exploded")
        if "sleep" in texts:
            time.sleep(3600)  # noqa: ASYNC251 - a scorer that blocks: exactly what isolation must survive
        if "crash" in texts:
            os._exit(7)
        scores = []
        for text in texts:
            if text == "nan":
                scores.append(math.nan)
            elif text == "huge":
                scores.append(1e9)
            elif text == "none":
                scores.append(None)
            else:
                scores.append(1.0 if text == prompt.reference_answer else 0.0)
        return scores[:-1] if "short" in texts else scores


def raising_reward(prompts, completions, **kwargs):
    raise ValueError("reward function raised on purpose")


def sleeping_reward(prompts, completions, **kwargs):
    time.sleep(3600)
    return [0.0] * len(completions)


def nan_reward(prompts, completions, **kwargs):
    return [math.nan] * len(completions)


def length_reward(prompts, completions, **kwargs):
    """A well-behaved TRL-style reward: 1.0 for completions of at most 3 characters."""
    return [1.0 if len(c) <= 3 else 0.0 for c in completions]
