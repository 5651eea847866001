"""Multi-turn environments for the Respond tests, loaded by file path.

`ToolTurnEnv` offers `add(a, b)` and a `slow()` tool (sleeps far past its deadline); its `respond`
is the default (run the tool calls) except for magic words in the model's message: "raise" raises,
"hang" blocks the worker past the respond deadline, "feedback" answers with a user message and a
per-turn reward. Scoring reads the final assistant message: 1.0 if it contains the reference answer.
"""

from __future__ import annotations

import asyncio
import time
from typing import ClassVar

from services.env.base import Environment, PromptItem, Reply, SplitName


def add(a: int, b: int) -> int:
    """Add two integers exactly.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


async def slow() -> str:
    """Never answers in time."""
    await asyncio.sleep(60)
    return "late"


class ToolTurnEnv(Environment):
    name: ClassVar[str] = "tool_turns"
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    max_turns: ClassVar[int] = 3
    respond_timeout: ClassVar[float] = 2.0
    tool_timeout: ClassVar[float] = 0.5

    def split_size(self, split: SplitName) -> int:
        return 0 if split == "train" else 4

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        messages = ({"role": "user", "content": f"What is {index} + 1000000007?"},)
        return PromptItem(
            id=f"t-{split}-{index}", messages=messages, reference_answer=str(index + 1000000007)
        )

    def tools(self):
        return [add, slow]

    async def respond(self, prompt: PromptItem, transcript: list) -> Reply:
        text = transcript[-1]["content"]
        if "raise" in text:
            raise ValueError("the env broke")
        if "hang" in text:
            time.sleep(30)  # noqa: ASYNC251 (blocks the worker: only the service deadline ends it)
        if "feedback" in text:
            return Reply(messages=[{"role": "user", "content": "Try again."}], reward=0.25)
        return await super().respond(prompt, transcript)

    def score_one(self, prompt: PromptItem, completion: str) -> float:
        return float(prompt.reference_answer in completion)
