"""The `tool_arithmetic` built-in: arithmetic on numbers too long to add in one's head, with a calculator.

A multi-turn tool task. The prompt is a chat question such as "What is 48213 + 99127? Use a
<tool_call>." whose operands have exactly `digits` digits (5 by default: a 135M model gets such sums
right only by luck). The environment offers one tool, `calculator(expression)` (exact integer
arithmetic through `services/env/tools/calculator.py`, described to the model in one short line: the
prompt's length is what a learner step costs); the chat template (or, for a template without tool
support, the rollout's hermes block) shows it to the model in the system message. The default
`respond` runs the model's `<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}
</tool_call>` and answers with a tool message holding the exact result; a malformed call gets an error
message; a turn without a call ends the episode. At most `max_turns` model turns (3: call, answer, one
spare for a retry).

Before the question the prompt shows `few_shot` worked exchanges as chat turns (user question,
assistant call, tool result, assistant answer; 2 by default). Measured with SmolLM2-135M-Instruct on
the prompts exactly as the rollout renders them (hermes tools block in the system message, tool
results as `<tool_response>` user turns; teacher-forced probability of a valid calculator call as the
first turn, 6 prompts): with the plain question "What is {expression}?" and one exchange, 0.000 (the
model copies the nearer `<tool_response>`: sampled at T=0.7, 52% of first turns start with it and
none holds a call), with two, 0.03; ending the question with "Use a <tool_call>." raises it to 0.003
(one exchange) and 0.14 (two, with the short tool description; 447 prompt tokens), and at step 0 of
a training run 50% of held-out episodes (16) end right, 94% with a call. docs/real-model.md has the
training runs.

Reward: 1.0 when the last integer of the final assistant message (its `<tool_call>` blocks removed,
thousands separators dropped) equals the exact result, else 0.0. Calling the tool earns nothing by
itself: the tool-call rate is meant to rise because calls lead to right answers, not because calls are
paid for (a format bonus would teach calling even where it does not help, and would let a group whose
members all call but all fail still see reward differences unrelated to correctness).

`reference_episode` / `wrong_episodes` are the scripted episodes `grpo-mesh check-env` plays:
a correct call then "The answer is N.", and wrong ones (a wrong answer with and without a call, a
malformed call).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.env.base import Environment, Message, PromptItem, Score, SplitName, final_text
from services.env.builtins.arithmetic import check_operators, evaluate

_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)
_INTEGER = re.compile(r"-?\d+")

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Use the calculator tool for arithmetic."
# Naming the call's tag last keeps a small model from copying the nearer `<tool_response>` (module doc).
DEFAULT_QUESTION = "What is {expression}? Use a <tool_call>."
# Worked exchanges shown before the question, as chat turns (`few_shot` of them, in this order).
EXAMPLES: tuple[tuple[str, int], ...] = (("2048 + 1931", 3979), ("123 + 456", 579))


class ToolArithmeticOptions(BaseModel):
    """Difficulty, turn budget and phrasing of the tool arithmetic task."""

    model_config = ConfigDict(extra="forbid")

    digits: int = Field(default=5, ge=1, le=30, description="Every operand has exactly this many digits.")
    terms: int = Field(default=2, ge=2, le=6, description="Number of operands in the expression.")
    operators: str = Field(default="+", description="Operators to draw from, any of '+', '-', '*'.")
    seed: int = Field(default=0, description="Seed of the train stream (the eval split uses its own stream).")
    eval_size: int = Field(default=200, ge=0, description="Number of held-out eval problems.")
    max_turns: int = Field(default=3, ge=1, le=16, description="Model turns per episode (calls + answer).")
    few_shot: int = Field(
        default=2, ge=0, le=len(EXAMPLES), description="Worked call-and-answer exchanges before the question."
    )
    question: str = Field(
        default=DEFAULT_QUESTION,
        description="The user message; {expression} becomes e.g. '4821 + 9912'.",
    )
    system_prompt: str | None = Field(
        default=DEFAULT_SYSTEM_PROMPT,
        description="System message (the tools block is added to it); none = the chat template's default.",
    )

    @field_validator("operators")
    @classmethod
    def _check_operators(cls, value: str) -> str:
        return check_operators(value)

    @field_validator("question")
    @classmethod
    def _check_question(cls, value: str) -> str:
        if "{expression}" not in value:
            raise ValueError("question must contain '{expression}'")
        return value


def problem_at(options: ToolArithmeticOptions, split: str, index: int) -> tuple[str, int]:
    """The index-th problem of a split: (expression like "48213 + 99127", exact result). Deterministic."""
    rng = random.Random(f"tool_arithmetic/{options.seed}/{split}/{index}")
    low, high = 10 ** (options.digits - 1), 10**options.digits - 1
    operands = [rng.randint(low, high) for _ in range(options.terms)]
    ops = [rng.choice(options.operators) for _ in range(options.terms - 1)]
    expression = str(operands[0]) + "".join(
        f" {op} {value}" for op, value in zip(ops, operands[1:], strict=True)
    )
    return expression, evaluate(operands, ops)


def final_answer(text: str) -> str | None:
    """The last integer of a reply outside its `<tool_call>` blocks ("12,345" counts as 12345), or None."""
    visible = _TOOL_CALL_BLOCK.sub(" ", text)
    found = _INTEGER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", visible))
    return found[-1] if found else None


def calculator_call(expression: str) -> str:
    """A model turn calling the calculator in the hermes format (what the reference episode says)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: The expression, for example "123 + 456".
    """
    from services.env.tools.calculator import calculator as exact

    return exact(expression)


class ToolArithmeticEnv(Environment[ToolArithmeticOptions]):
    """Long-number arithmetic with a calculator tool; reward on the final answer only."""

    name: ClassVar[str] = "tool_arithmetic"
    description: ClassVar[str] = (
        "Arithmetic on long numbers with a calculator tool; reward on the final answer."
    )
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)
    max_turns: ClassVar[int] = 3

    def tools(self) -> Sequence[Callable[..., Any]]:
        return (calculator,)

    def split_size(self, split: SplitName) -> int:
        return 0 if split == "train" else self.options.eval_size

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        expression, result = problem_at(self.options, split, index)
        messages: list[dict[str, str]] = []
        if self.options.system_prompt:
            messages.append({"role": "system", "content": self.options.system_prompt})
        for example, value in EXAMPLES[: self.options.few_shot]:
            messages += [
                {"role": "user", "content": self.options.question.format(expression=example)},
                {"role": "assistant", "content": calculator_call(example)},
                {"role": "tool", "content": str(value)},
                {"role": "assistant", "content": f"The answer is {value}."},
            ]
        messages.append({"role": "user", "content": self.options.question.format(expression=expression)})
        return PromptItem(
            id=f"{self.name}-{split}-{index}",
            messages=tuple(messages),
            reference_answer=str(result),
            metadata={"expression": expression},
        )

    def score_one(self, prompt: PromptItem, completion: str) -> Score:
        predicted = final_answer(completion)
        if predicted is None:
            return Score(reward=0.0, details={"reason": "no integer in the final answer"})
        return Score(reward=float(int(predicted) == int(prompt.reference_answer)), parsed_answer=predicted)

    async def score_episodes(
        self, prompt: PromptItem, transcripts: Sequence[Sequence[Message]]
    ) -> list[Score | float | None]:
        """`score_one` on each final assistant message, with the episode's tool use in the details."""
        scores: list[Score | float | None] = []
        for transcript in transcripts:
            score = self.score_one(prompt, final_text(transcript))
            called = sum(1 for m in transcript if m.get("role") == "tool")
            score.details["tool_messages"] = str(called)
            scores.append(score)
        return scores

    # ----------------------------------------------------------------- check-env hooks
    def reference_completion(self, prompt: PromptItem) -> str:
        return f"The answer is {prompt.reference_answer}."

    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        answer = int(prompt.reference_answer)
        return [f"The answer is {answer + 1}.", "", calculator_call(prompt.metadata["expression"])]

    def reference_episode(self, prompt: PromptItem) -> list[str]:
        """Assistant turns of a solved episode: call the calculator, then state its result."""
        return [calculator_call(prompt.metadata["expression"]), self.reference_completion(prompt)]

    def wrong_episodes(self, prompt: PromptItem) -> list[list[str]]:
        """Episodes that must score below the threshold: calling the tool alone does not pay."""
        answer = int(prompt.reference_answer)
        call = calculator_call(prompt.metadata["expression"])
        return [
            [f"The answer is {answer + 1}."],
            [call, f"The answer is {answer - 1}."],
            ['<tool_call>{"name": "calculator", "arguments": </tool_call>', "I do not know."],
        ]
