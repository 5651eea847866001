"""`grpo-mesh check-env ENV_SPEC [--n 8] [--split eval] [--env-arg k=v ...]`: validate an environment
before training.

It loads the environment exactly as the service would (same loader, same option validation, same
cursor, same isolated scoring worker), then:

1. samples `--n` prompts twice from two fresh instances and requires them to be identical (seeded);
2. scores each prompt's reference completion (must reach the success threshold) and a few wrong
   completions (must stay below it), through the scoring pool, so a crash, hang, NaN or
   out-of-range reward shows up here as it would in training, with the same failure label
   ("exception: ValueError: ..." for a raising `score_one`);
3. prints a table and exits 0, or exits 1 listing every problem (2 when the env cannot be loaded or
   the flags are invalid).

Its flags are the service's recipe fields (config.EnvRecipeFields: `--env-arg`, `--reward-funcs`,
`--seed`, `--score-timeout-seconds`, ...) plus `--n` and `--split`, parsed by pydantic-settings
from the command line only: no `GRPO_ENV__*` variables or run-config file, so what is checked is what
was typed.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import Literal, TextIO

from pydantic import Field
from pydantic_settings import CliPositionalArg

from services.common.config import CommandSettings, parse_cli
from services.common.errors import FailedPrecondition
from services.env.base import PromptItem, Score, SplitName
from services.env.config import EnvRecipeFields
from services.env.cursor import PromptCursor
from services.env.loader import EnvLoadError, EnvRecipe, load_environment, load_recipe
from services.env.scoring import ScoringPool

PROG = "grpo-mesh check-env"


class CheckSettings(EnvRecipeFields, CommandSettings):
    """Smoke-test an environment: sample prompts, score reference and wrong answers in a scoring worker.

    Exit 0 when every reference scores >= the success threshold and every wrong answer below it,
    1 listing every problem, 2 when the environment cannot be loaded or a flag is invalid.
    """

    spec: CliPositionalArg[str] = Field(description=EnvRecipeFields.model_fields["spec"].description)
    n: int = Field(default=8, ge=1, description="Prompts to sample and check.")
    split: Literal["train", "eval"] = Field(default="train", description="Split to sample from.")


def parse(argv: list[str], prog: str = PROG) -> CheckSettings:
    """The command line (`--help` generated from the field descriptions); SystemExit(2) on a bad one."""
    return parse_cli(CheckSettings, [_short_flag(arg) for arg in argv], prog)


def _short_flag(arg: str) -> str:
    """`--n 8` / `--n=8` → `-n …`: pydantic-settings names a one-letter field `-n`, the docs say `--n`."""
    return "-n" + arg[3:] if arg == "--n" or arg.startswith("--n=") else arg


@dataclass
class CheckReport:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _short(text: str, width: int = 40) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def _fmt(score: Score) -> str:
    return f"FAIL({score.failure})" if score.failure or score.reward is None else f"{score.reward:g}"


def _prompt_text(item: PromptItem) -> str:
    return item.text or (item.messages[-1]["content"] if item.messages else "")


def _key(item: PromptItem) -> tuple[str, str, str]:
    return item.id, _prompt_text(item), item.reference_answer


async def run_check(recipe: EnvRecipe, n: int, split: SplitName, score_timeout: float) -> CheckReport:
    """Do the checks; raises EnvLoadError when the environment cannot be loaded at all."""
    report = CheckReport()
    loaded = load_recipe(recipe)
    env, scorer = loaded.env, loaded.scorer
    await env.setup()
    try:
        prompts = (await PromptCursor(env).take(n, split)).prompts
    except FailedPrecondition as exc:  # e.g. no eval split
        report.problems.append(str(exc))
        return report
    if len(prompts) < n:
        report.warnings.append(f"the {split} split holds {len(prompts)} prompts; checked those, not {n}")
    again = load_environment(recipe)
    await again.setup()
    second = (await PromptCursor(again).take(n, split)).prompts
    if [_key(p) for p in second] != [_key(p) for p in prompts]:
        report.problems.append("prompts are not deterministic: two instances with the same seed differ")
    for item in prompts:
        if not item.text and not item.messages:
            report.problems.append(f"prompt {item.id!r} has neither text nor messages")
    pool = ScoringPool(recipe, workers=1, timeout=score_timeout)
    await pool.start()
    try:
        for item in prompts:
            reference = scorer.reference_completion(item)
            wrong = scorer.wrong_answers(item)
            scores = await pool.score(item, [reference, *wrong])
            ref_score, wrong_scores = scores[0], scores[1:]
            status = "ok"
            if not reference:
                report.warnings.append(f"{item.id}: no reference answer, reference not checked")
            elif ref_score.failure or ref_score.reward is None:
                status = "PROBLEM"
                report.problems.append(f"{item.id}: scoring the reference failed: {ref_score.failure}")
            elif ref_score.reward < scorer.success_threshold:
                status = "PROBLEM"
                report.problems.append(
                    f"{item.id}: reference {reference!r} scored {ref_score.reward:g} "
                    f"(< success threshold {scorer.success_threshold:g})"
                )
            for text, score in zip(wrong, wrong_scores, strict=True):
                if score.failure or score.reward is None:
                    status = "PROBLEM"
                    report.problems.append(
                        f"{item.id}: scoring wrong answer {text!r} failed: {score.failure}"
                    )
                elif score.reward >= scorer.success_threshold:
                    status = "PROBLEM"
                    report.problems.append(f"{item.id}: wrong answer {text!r} scored {score.reward:g}")
            wrong_cell = ", ".join(_fmt(s) for s in wrong_scores)
            report.rows.append(
                (_short(_prompt_text(item)), _short(reference, 24), _fmt(ref_score), wrong_cell)
            )
            if status != "ok":
                report.rows[-1] = (*report.rows[-1][:3], wrong_cell + "  <-- PROBLEM")
    finally:
        await pool.close()
    return report


def print_table(report: CheckReport, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    header = ("prompt", "reference", "ref reward", "wrong-answer rewards")
    rows = [header, *report.rows]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for index, row in enumerate(rows):
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)),
            row[3],
            file=out,
        )
        if index == 0:
            print("  ".join("-" * w for w in widths), "-" * len(header[3]), file=out)


def main(argv: list[str] | None = None) -> int:
    settings = parse(sys.argv[1:] if argv is None else argv)
    try:
        recipe = settings.recipe()
        report = asyncio.run(run_check(recipe, settings.n, settings.split, settings.score_timeout_seconds))
    except EnvLoadError as exc:
        print(f"error: cannot load environment {settings.spec!r}:\n{exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"error: environment {settings.spec!r} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print_table(report)
    for warning in report.warnings:
        print(f"warning: {warning}")
    if report.problems:
        print(f"\n{len(report.problems)} problem(s):", file=sys.stderr)
        for problem in report.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"\nOK: {len(report.rows)} prompts, references score >= threshold, wrong answers below it.")
    return 0
