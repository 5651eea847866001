"""The `gsm8k` built-in: grade-school math word problems, scored with math-verify.

Data: a local file (`path=...`, JSON lines, a JSON list, or parquet when pyarrow is installed) with
`question` / `answer` fields, where the answer ends with "#### <number>" as in the original data; or,
without `path`, the Hugging Face dataset `openai/gsm8k` through `datasets` (needs the package and a
network). The eval split is `eval_path`, else the dataset's test split, else the last `eval_size`
rows of the local file (after a seeded shuffle), capped at `eval_size` rows (0 = all).

Scoring: the text after the last "####" in the completion (the whole completion if it has none) is
parsed and compared with the gold number by math-verify (`parse` + `verify`). Fallback for plain
numbers: when math-verify raises or finds nothing, the last number in that text (commas removed) is
compared numerically with the gold number (|a - b| <= 1e-6). Reward 1.0 if equal, else 0.0.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from services.env.base import Environment, PromptItem, Score, SplitName

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
DEFAULT_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


class Gsm8kOptions(BaseModel):
    """Where the data comes from and how prompts are phrased."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(default=None, description="Local train file (.jsonl, .json or .parquet).")
    eval_path: str | None = Field(default=None, description="Local eval file; default: held out from path.")
    dataset: str = Field(default="openai/gsm8k", description="HF dataset name, used when path is not set.")
    dataset_config: str = Field(default="main", description="HF dataset config name.")
    eval_size: int = Field(default=200, ge=0, description="Eval prompts (held out / cap); 0 = all.")
    question_field: str = Field(default="question", description="Field holding the question.")
    answer_field: str = Field(default="answer", description="Field holding the solution ending in '#### n'.")
    instruction: str = Field(default=DEFAULT_INSTRUCTION, description="Appended to every question.")
    chat: bool = Field(default=True, description="Serve prompts as chat messages (else plain text).")
    system_prompt: str | None = Field(default=None, description="Optional system message (chat only).")
    seed: int = Field(default=0, description="Seed of the train order and of the hold-out split.")
    levels: int = Field(
        default=0,
        ge=0,
        le=20,
        description="Difficulty levels for the curriculum: the train rows split into this many levels by "
        "solution length (reasoning lines before '####'), shortest first, named 1..N; 0 = none.",
    )


def gold_answer(solution: str) -> str:
    """The number after the last "####" of a GSM8K solution, commas removed."""
    if "####" not in solution:
        raise ValueError(f"no '####' in answer {solution[:80]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def solution_steps(solution: str) -> int:
    """A solution's length in reasoning steps: its non-empty lines before the '####' line."""
    return sum(1 for line in solution.split("####")[0].splitlines() if line.strip())


def length_levels(solutions: list[str], count: int) -> list[list[int]]:
    """Row indices in `count` levels of (nearly) equal size by solution length, shortest first (ties
    by row order, so the split is deterministic); ValueError when there are fewer rows than levels."""
    if count > len(solutions):
        raise ValueError(f"gsm8k: levels={count} needs at least {count} train rows, got {len(solutions)}")
    order = sorted(range(len(solutions)), key=lambda i: (solution_steps(solutions[i]), i))
    bounds = [round(k * len(order) / count) for k in range(count + 1)]
    return [order[bounds[k] : bounds[k + 1]] for k in range(count)]


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"gsm8k data file not found: {path}")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as exc:
            raise RuntimeError("reading parquet needs pyarrow (pip install pyarrow), or use .jsonl") from exc
        return pq.read_table(path).to_pylist()
    text = path.read_text()
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _load_hf(name: str, config: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    try:
        import datasets
    except ImportError as exc:
        raise RuntimeError(
            f"loading {name!r} by name needs the `datasets` package and a network; "
            "or pass path=/local/gsm8k.jsonl"
        ) from exc
    data = datasets.load_dataset(name, config)
    return list(data["train"]), list(data["test"])


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def score_gsm8k(completion: str, gold: str) -> tuple[float, str, str]:
    """(reward, parsed answer, method) for one completion against the gold number."""
    text = completion.rsplit("####", 1)[1] if "####" in completion else completion
    method = "fallback"
    try:
        from math_verify import parse, verify

        predicted = parse(text)
        if predicted:
            ok = verify(parse(gold), predicted)
            return (1.0 if ok else 0.0), str(predicted[-1]), "math_verify"
    except Exception as exc:  # math-verify can raise on odd input; the plain-number fallback decides then
        method = f"fallback ({type(exc).__name__} in math-verify)"
    number = _last_number(text)
    if number is None:
        return 0.0, "", "no_number"
    return (1.0 if abs(number - float(gold)) <= 1e-6 else 0.0), f"{number:g}", method


class Gsm8kEnv(Environment[Gsm8kOptions]):
    """GSM8K from a local file or the HF hub; reward 1.0 when the final answer equals the gold number."""

    name: ClassVar[str] = "gsm8k"
    description: ClassVar[str] = "GSM8K grade-school math; final answer after '####', math-verify scoring."
    reward_range: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def __init__(self, options: Gsm8kOptions | None = None) -> None:
        super().__init__(options)
        # The data, loaded by setup() (service) — not a cursor: positions live in the service's PromptCursor.
        self._rows: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
        self._levels: list[list[int]] = []  # train row indices of each level (options.levels > 0)

    async def setup(self) -> None:
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        o = self.options
        if o.path is None:
            train, evaluation = _load_hf(o.dataset, o.dataset_config)
        else:
            train = _read_rows(Path(o.path))
            if o.eval_path is not None:
                evaluation = _read_rows(Path(o.eval_path))
            else:
                random.Random(f"gsm8k/holdout/{o.seed}").shuffle(train)
                cut = min(o.eval_size, len(train) // 2)
                train, evaluation = train[: len(train) - cut], train[len(train) - cut :]
        for split, rows in (("train", train), ("eval", evaluation)):
            for i, row in enumerate(rows[:5]):
                missing = {o.question_field, o.answer_field} - set(row)
                if missing:
                    raise ValueError(f"gsm8k {split} row {i} lacks field(s) {sorted(missing)}: {sorted(row)}")
        if o.eval_size:
            evaluation = evaluation[: o.eval_size]
        if not train:
            raise ValueError("gsm8k train split is empty")
        self._rows = {"train": train, "eval": evaluation}
        if o.levels:
            self._levels = length_levels([str(row[o.answer_field]) for row in train], o.levels)

    def split_size(self, split: SplitName) -> int:
        return len(self._rows[split])

    def levels(self) -> list[str]:
        return [str(k + 1) for k in range(self.options.levels)]

    def level_size(self, level: str) -> int:
        return len(self._levels[int(level) - 1])

    def level_prompt_at(self, level: str, index: int) -> PromptItem:
        return self.prompt_at("train", self._levels[int(level) - 1][index])

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        row = self._rows[split][index]
        o = self.options
        content = f"{row[o.question_field]}\n{o.instruction}".strip()
        answer = gold_answer(str(row[o.answer_field]))
        prompt_id = f"gsm8k-{split}-{index}"
        if not o.chat:
            return PromptItem(id=prompt_id, text=content, reference_answer=answer)
        messages = [{"role": "system", "content": o.system_prompt}] if o.system_prompt else []
        messages.append({"role": "user", "content": content})
        return PromptItem(id=prompt_id, messages=tuple(messages), reference_answer=answer)

    def score_one(self, prompt: PromptItem, completion: str) -> Score:
        reward, parsed, method = score_gsm8k(completion, prompt.reference_answer)
        return Score(reward=reward, parsed_answer=parsed, details={"method": method})

    def reference_completion(self, prompt: PromptItem) -> str:
        return f"The answer is computed step by step.\n#### {prompt.reference_answer}"

    def wrong_answers(self, prompt: PromptItem) -> list[str]:
        gold = float(prompt.reference_answer)
        return [f"#### {gold + 1:g}", "I cannot solve this.", ""]
