"""`python -m services.env check ENV_SPEC`: validate an environment before training.

It loads the environment exactly as the service would (same loader, same option validation, same
isolated scoring worker), then:

1. samples `--n` prompts twice from two fresh instances and requires them to be identical (seeded);
2. scores each prompt's reference completion (must reach the success threshold) and a few wrong
   completions (must stay below it), through the scoring pool, so a crash, hang, NaN or
   out-of-range reward shows up here as it would in training;
3. prints a table and exits 0, or exits 1 listing every problem (2 when the env cannot be loaded).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field
from typing import TextIO

from services.env.base import Environment, PromptItem, Score
from services.env.loader import EnvLoadError, EnvRecipe, load_environment, parse_env_args
from services.env.scoring import ScoringPool


@dataclass
class CheckReport:
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.env check",
        description="Smoke-test an environment: sample prompts, score reference and wrong answers.",
    )
    parser.add_argument("spec", help="arithmetic, gsm8k, reasoning_gym:<task>, pkg.mod:Name or file.py:Name")
    parser.add_argument("--n", type=int, default=8, help="prompts to sample (default 8)")
    parser.add_argument("--split", choices=["train", "eval"], default="train", help="split to sample")
    parser.add_argument(
        "--env-arg", action="append", default=[], metavar="K=V", help="env option (repeatable)"
    )
    parser.add_argument(
        "--reward-func", action="append", default=[], help="extra reward function (repeatable)"
    )
    parser.add_argument("--reward-weight", action="append", type=float, default=[], help="its weight")
    parser.add_argument("--env-reward-weight", type=float, default=1.0, help="weight of the env's own reward")
    parser.add_argument("--timeout", type=float, default=30.0, help="scoring timeout per call, seconds")
    return parser


def _short(text: str, width: int = 40) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


def _fmt(score: Score) -> str:
    return f"FAIL({score.failure})" if score.failure or score.reward is None else f"{score.reward:g}"


def _prompt_text(item: PromptItem) -> str:
    return item.text or (item.messages[-1]["content"] if item.messages else "")


def _key(item: PromptItem) -> tuple[str, str, str]:
    return item.id, _prompt_text(item), item.reference_answer


async def run_check(recipe: EnvRecipe, n: int, split: str, score_timeout: float) -> CheckReport:
    """Do the checks; raises EnvLoadError when the environment cannot be loaded at all."""
    report = CheckReport()
    env: Environment = load_environment(recipe)
    await env.setup()
    if split == "eval" and env.split_size("eval") == 0:
        report.problems.append("the environment has no eval split (eval_size = 0)")
        return report
    prompts = await env.sample(n, split)  # type: ignore[arg-type]
    again = load_environment(recipe)
    await again.setup()
    second = await again.sample(n, split)  # type: ignore[arg-type]
    if [_key(p) for p in second] != [_key(p) for p in prompts]:
        report.problems.append("prompts are not deterministic: two instances with the same seed differ")
    for item in prompts:
        if not item.text and not item.messages:
            report.problems.append(f"prompt {item.id!r} has neither text nor messages")
    pool = ScoringPool(recipe, workers=1, timeout=score_timeout)
    await pool.start()
    try:
        for item in prompts:
            reference = env.reference_completion(item)
            wrong = env.wrong_answers(item)
            scores = await pool.score(item, [reference, *wrong])
            ref_score, wrong_scores = scores[0], scores[1:]
            status = "ok"
            if not reference:
                report.warnings.append(f"{item.id}: no reference answer, reference not checked")
            elif ref_score.failure or ref_score.reward is None:
                status = "PROBLEM"
                report.problems.append(f"{item.id}: scoring the reference failed: {ref_score.failure}")
            elif ref_score.reward < env.success_threshold:
                status = "PROBLEM"
                report.problems.append(
                    f"{item.id}: reference {reference!r} scored {ref_score.reward:g} "
                    f"(< success threshold {env.success_threshold:g})"
                )
            for text, score in zip(wrong, wrong_scores, strict=True):
                if score.failure or score.reward is None:
                    status = "PROBLEM"
                    report.problems.append(
                        f"{item.id}: scoring wrong answer {text!r} failed: {score.failure}"
                    )
                elif score.reward >= env.success_threshold:
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
    args = build_parser().parse_args(argv)
    if args.n < 1:
        print("error: --n must be >= 1", file=sys.stderr)
        return 2
    try:
        recipe = EnvRecipe(
            spec=args.spec,
            env_args=parse_env_args(args.env_arg),
            reward_funcs=tuple(args.reward_func),
            reward_weights=tuple(args.reward_weight),
            env_reward_weight=args.env_reward_weight,
        )
        report = asyncio.run(run_check(recipe, args.n, args.split, args.timeout))
    except EnvLoadError as exc:
        print(f"error: cannot load environment {args.spec!r}:\n{exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        print(f"error: environment {args.spec!r} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
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
