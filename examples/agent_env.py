"""A multi-turn, tool-using environment for grpo-mesh (docs/agents.md walks through it).

The model is asked a question about a small made-up inventory it cannot know; it must look the
numbers up with the `stock` tool and may compute with `calculator`. The environment's turn is the
default one: run the tool calls of the model's last message and answer with their results; a turn
without a call ends the episode, which is then scored on the final answer.

    grpo-mesh check-env examples/agent_env.py:InventoryEnv --n 4
    make demo ARGS="--env examples/agent_env.py:InventoryEnv --max-tokens 48"
"""

from __future__ import annotations

import random
import re
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from services.env.base import Environment, PromptItem, Score, SplitName
from services.env.tools.calculator import calculator

# The "database" the model can only reach through the tool.
STOCK = {"apples": 17, "pears": 42, "plums": 8, "figs": 23, "limes": 31, "kiwis": 12}


def stock(item: str) -> int:
    """How many of an item are in stock.

    Args:
        item: the item's name in plural, e.g. "apples".
    """
    if item not in STOCK:
        raise ValueError(f"unknown item {item!r}; known: {', '.join(STOCK)}")
    return STOCK[item]


class InventoryOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(default=4, ge=1, le=8, description="Model turns per episode.")
    seed: int = Field(default=0, description="Seed of the prompt stream.")
    eval_size: int = Field(default=50, ge=0, description="Held-out prompts.")


class InventoryEnv(Environment[InventoryOptions]):
    """How many of two items are in stock together? Reward 1 for the exact total."""

    name: ClassVar[str] = "inventory"
    description: ClassVar[str] = "Look up two stock counts with a tool and add them."
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    respond_timeout: ClassVar[float] = 10.0  # one environment turn (every tool call in it)
    tool_timeout: ClassVar[float] = 2.0  # one tool call

    def tools(self):
        return [stock, calculator]  # their JSON schemas come from the type hints and docstrings

    def split_size(self, split: SplitName) -> int:
        return 0 if split == "train" else self.options.eval_size

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        rng = random.Random(f"{self.options.seed}-{split}-{index}")
        first, second = rng.sample(sorted(STOCK), 2)
        question = f"How many {first} and {second} are in stock together? Look them up, then answer."
        return PromptItem(
            id=f"inventory-{split}-{index}",
            messages=({"role": "user", "content": question},),
            reference_answer=str(STOCK[first] + STOCK[second]),
            metadata={"items": f"{first},{second}"},
        )

    def score_one(self, prompt: PromptItem, completion: str) -> Score:
        # `completion` is the episode's final assistant message (its earlier turns made the calls)
        numbers = re.findall(r"-?\d+", completion.split("</tool_call>")[-1])
        if not numbers:
            return Score(reward=0.0, details={"reason": "no number in the final answer"})
        return Score(reward=float(numbers[-1] == prompt.reference_answer), parsed_answer=numbers[-1])

    # What `grpo-mesh check-env` plays: a right episode (one assistant message per model turn) ...
    def reference_episode(self, prompt: PromptItem) -> list[str]:
        first, second = prompt.metadata["items"].split(",")
        call = '<tool_call>{{"name": "stock", "arguments": {{"item": "{}"}}}}</tool_call>'
        return [call.format(first) + call.format(second), f"There are {prompt.reference_answer}."]

    # ... and wrong ones, which must score below the success threshold.
    def wrong_episodes(self, prompt: PromptItem) -> list[list[str]]:
        return [
            ["I think there are 3."],
            ['<tool_call>{"name": "stock", "arguments": {}}</tool_call>', "No idea."],
        ]
