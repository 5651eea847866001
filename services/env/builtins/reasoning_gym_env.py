"""The `reasoning_gym:<task>` built-in: any reasoning-gym procedural task, scored by its own verifier.

reasoning-gym generates every item from (seed, index), so nothing is downloaded: the train split is
`reasoning_gym.create_dataset(task, seed=seed, size=size, **task_config)`, the eval split the same
with a derived seed and `size=eval_size`. Prompts carry their split and index in `metadata`, so each
scoring worker regenerates the exact entry and calls `dataset.score_answer(answer, entry)`.

The answer given to the verifier is, with `answer_extraction="answer_tags"` (default), the content of
the last <answer>...</answer> block, or the whole stripped completion when there is none; with
"raw", the stripped completion. Chat prompts use reasoning-gym's default system prompt (which asks
for <answer> tags) unless `system_prompt` says otherwise.
"""

from __future__ import annotations

import asyncio
from functools import cache, cached_property
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.env.base import Environment, PromptItem, Score, SplitName
from services.env.rewards import extract_answer_tag

EVAL_SEED_OFFSET = 1_000_003


class ReasoningGymOptions(BaseModel):
    """Which task, its generator config, split sizes and prompt style."""

    model_config = ConfigDict(extra="forbid")

    task: str = Field(description="reasoning-gym task name, e.g. leg_counting, basic_arithmetic.")
    task_config: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for the task's dataset config."
    )
    seed: int = Field(default=0, description="Seed of the train items (eval uses seed + 1000003).")
    size: int = Field(default=10_000, ge=1, description="Train items per epoch.")
    eval_size: int = Field(default=200, ge=0, description="Eval items.")
    answer_extraction: Literal["answer_tags", "raw"] = Field(
        default="answer_tags", description="How the answer is taken from the completion."
    )
    chat: bool = Field(default=True, description="Serve prompts as chat messages (else plain text).")
    system_prompt: str | None = Field(
        default=None, description="System message (chat only); default: reasoning-gym's default prompt."
    )


class ReasoningGymEnv(Environment[ReasoningGymOptions]):
    """One reasoning-gym task; reward = the task's own `score_answer` (0..1).

    Each task is its own environment class, named "reasoning_gym:<task>" (the name prompts carry and
    the train shuffle is keyed by): `task_environment(task)` makes it; the loader uses that.
    """

    name: ClassVar[str] = "reasoning_gym"
    description: ClassVar[str] = "A reasoning-gym procedural task, scored by its own verifier."
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def __init__(self, options: ReasoningGymOptions) -> None:
        super().__init__(options)
        from reasoning_gym.factory import DATASETS

        if options.task not in DATASETS:
            known = ", ".join(sorted(DATASETS))
            raise ValueError(f"unknown reasoning_gym task {options.task!r}; known tasks: {known}")

    @cached_property
    def _datasets(self) -> dict[str, Any]:
        import reasoning_gym

        o = self.options
        return {
            "train": reasoning_gym.create_dataset(o.task, seed=o.seed, size=o.size, **o.task_config),
            "eval": reasoning_gym.create_dataset(
                o.task, seed=o.seed + EVAL_SEED_OFFSET, size=max(o.eval_size, 1), **o.task_config
            ),
        }

    async def setup(self) -> None:
        await asyncio.to_thread(lambda: self._datasets)

    def setup_scorer(self) -> None:
        _ = self._datasets

    def split_size(self, split: SplitName) -> int:
        return self.options.size if split == "train" else self.options.eval_size

    def _entry(self, split: str, index: int) -> dict[str, Any]:
        return self._datasets[split][index]

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        entry = self._entry(split, index)
        metadata = {"split": split, "index": str(index)}
        prompt_id = f"{self.name}-{split}-{index}"
        answer = "" if entry.get("answer") is None else str(entry["answer"])
        if not self.options.chat:
            return PromptItem(
                id=prompt_id, text=entry["question"], reference_answer=answer, metadata=metadata
            )
        from reasoning_gym.utils import SYSTEM_PROMPTS

        system = (
            self.options.system_prompt
            if self.options.system_prompt is not None
            else SYSTEM_PROMPTS["default"]
        )
        messages = ({"role": "system", "content": system}, {"role": "user", "content": entry["question"]})
        return PromptItem(id=prompt_id, messages=messages, reference_answer=answer, metadata=metadata)

    def _answer(self, completion: str) -> str:
        if self.options.answer_extraction == "answer_tags":
            tagged = extract_answer_tag(completion)
            if tagged is not None:
                return tagged
        return completion.strip()

    def score_one(self, prompt: PromptItem, completion: str) -> Score:
        try:
            split, index = prompt.metadata["split"], int(prompt.metadata["index"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"prompt {prompt.id!r} lacks reasoning_gym split/index metadata") from exc
        entry = self._entry(split, index)
        answer = self._answer(completion)
        reward = float(self._datasets[split].score_answer(answer, entry))
        return Score(reward=reward, parsed_answer=answer[:200])

    def reference_completion(self, prompt: PromptItem) -> str:
        if self.options.answer_extraction == "answer_tags":
            return f"<answer>{prompt.reference_answer}</answer>"
        return prompt.reference_answer

    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        return ["<answer>definitely not the answer</answer>", ""]


@cache
def task_environment(task: str) -> type[ReasoningGymEnv]:
    """The environment class of one reasoning-gym task, named "reasoning_gym:<task>" (one per task and
    process, so the same spec always gives the same class)."""
    return type(f"ReasoningGymEnv[{task}]", (ReasoningGymEnv,), {"name": f"reasoning_gym:{task}"})
