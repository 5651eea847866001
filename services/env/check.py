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
import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TextIO

from pydantic import Field
from pydantic_settings import CliPositionalArg

from services.common.config import CommandSettings, parse_cli
from services.common.errors import FailedPrecondition
from services.env.base import Environment, Message, PromptItem, Reply, Score, Scorer, SplitName, final_text
from services.env.config import EnvRecipeFields
from services.env.cursor import PromptCursor
from services.env.loader import EnvLoadError, EnvRecipe, load_environment, load_recipe
from services.env.scoring import ScoringPool, validate_scores

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
    episode_rows: list[tuple[str, str, str, str]] = field(default_factory=list)
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
    if env.turn_limit > 1:
        await check_episodes(env, scorer, prompts, score_timeout, report)
    return report


# --------------------------------------------------------------------------- multi-turn episodes


@dataclass
class Episode:
    """A scripted episode as played: its transcript and what the environment's replies said."""

    transcript: list[Message] = field(default_factory=list)
    turn_reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_error_texts: list[str] = field(default_factory=list)
    ended: bool = False  # `done` or the turn limit came before the script ran out
    unplayed: int = 0  # scripted turns after the episode had ended
    problem: str = ""  # respond raised or overran


def scripted_episodes(
    env: Environment[Any], scorer: Scorer, item: PromptItem
) -> tuple[list[str], list[list[str]]]:
    """The reference episode and the wrong ones: the env's hooks, else one-turn episodes."""
    reference_hook = getattr(env, "reference_episode", None)
    wrong_hook = getattr(env, "wrong_episodes", None)
    reference = (
        list(reference_hook(item)) if callable(reference_hook) else [scorer.reference_completion(item)]
    )
    if callable(wrong_hook):
        wrong = [list(turns) for turns in wrong_hook(item)]
    else:
        wrong = [[text] for text in scorer.wrong_answers(item)]
    return reference, wrong


async def _respond(env: Environment[Any], item: PromptItem, transcript: list[Message]) -> Reply:
    result: Any = env.respond(item, [dict(m) for m in transcript])
    if inspect.isawaitable(result):
        result = await asyncio.wait_for(result, env.respond_timeout)
    if not isinstance(result, Reply):
        raise TypeError(f"respond returned {type(result).__name__}, expected a Reply")
    return result


async def play_episode(env: Environment[Any], item: PromptItem, turns: Sequence[str]) -> Episode:
    """Play the scripted assistant turns through `respond`, as the scheduler drives an episode."""
    episode = Episode()
    limit = env.turn_limit
    for number, text in enumerate(turns, start=1):
        episode.transcript.append({"role": "assistant", "content": text})
        if number >= limit:
            episode.ended = True
        else:
            try:
                reply = await _respond(env, item, episode.transcript)
            except TimeoutError:
                episode.problem = (
                    f"respond ran past respond_timeout={env.respond_timeout:g}s at turn {number}"
                )
                return episode
            except Exception as exc:
                episode.problem = f"respond raised at turn {number}: {type(exc).__name__}: {exc}"
                return episode
            episode.turn_reward += reply.reward or 0.0
            episode.tool_calls += reply.tool_calls
            episode.tool_errors += reply.tool_errors
            if reply.tool_errors:
                episode.tool_error_texts += [str(m.get("content", "")) for m in reply.messages]
            episode.transcript.extend(dict(m) for m in reply.messages)
            episode.ended = reply.done
        if episode.ended:
            episode.unplayed = len(turns) - number
            break
    return episode


async def score_played(
    env: Environment[Any], scorer: Scorer, item: PromptItem, episodes: list[Episode], score_seconds: float
) -> list[Score]:
    """Scores of the episodes' final transcripts (`score_episodes`, per-turn rewards added), validated."""
    transcripts = [e.transcript for e in episodes]
    try:
        if scorer is env:
            raw = await asyncio.wait_for(env.score_episodes(item, transcripts), score_seconds)
        else:  # reward functions score the final texts
            raw = await asyncio.wait_for(
                scorer.score(item, [final_text(t) for t in transcripts]), score_seconds
            )
    except TimeoutError:
        return [Score(reward=None, failure=f"timeout: scoring ran past {score_seconds:g}s")] * len(episodes)
    except Exception as exc:
        return [Score(reward=None, failure=f"exception: {type(exc).__name__}: {exc}")] * len(episodes)
    scores = validate_scores(raw, len(episodes), scorer.reward_range)
    for score, episode in zip(scores, episodes, strict=True):
        if score.reward is not None and not score.failure:
            score.reward += episode.turn_reward
    return scores


async def check_episodes(
    env: Environment[Any],
    scorer: Scorer,
    prompts: list[PromptItem],
    score_seconds: float,
    report: CheckReport,
) -> None:
    """Play and score each prompt's scripted episodes; record problems and one table row per prompt."""
    if list(env.tools()):
        try:
            from services.env.episodes import tools_json

            tools_json(env)
        except Exception as exc:
            report.problems.append(f"the tools' schemas do not build: {type(exc).__name__}: {exc}")
    threshold = scorer.success_threshold
    for item in prompts:
        reference, wrong = scripted_episodes(env, scorer, item)
        if len(reference) > env.turn_limit:
            report.problems.append(
                f"{item.id}: the reference episode has {len(reference)} turns, max_turns is {env.turn_limit}"
            )
        played = [await play_episode(env, item, turns) for turns in [reference, *wrong]]
        scores = await score_played(env, scorer, item, played, score_seconds)
        problems: list[str] = []
        for index, (turns, episode, score) in enumerate(
            zip([reference, *wrong], played, scores, strict=True)
        ):
            name = (
                "the reference episode" if index == 0 else f"wrong episode {_short(' | '.join(turns), 60)!r}"
            )
            if episode.problem:
                problems.append(f"{name}: {episode.problem}")
            if episode.unplayed:
                problems.append(f"{name} ended with {episode.unplayed} scripted turn(s) left unplayed")
            if score.failure or score.reward is None:
                problems.append(f"scoring {name} failed: {score.failure}")
            elif index == 0 and score.reward < threshold:
                problems.append(f"{name} scored {score.reward:g} (< success threshold {threshold:g})")
            elif index > 0 and score.reward >= threshold:
                problems.append(f"{name} scored {score.reward:g} (>= success threshold {threshold:g})")
        if played[0].tool_errors:
            problems.append(f"the reference episode's tool calls failed: {played[0].tool_error_texts}")
        if not played[0].ended and not played[0].problem:
            problems.append("the reference episode did not end (no `done` before its script ran out)")
        report.problems += [f"{item.id}: {p}" for p in problems]
        wrong_cell = ", ".join(_fmt(s) for s in scores[1:]) + ("  <-- PROBLEM" if problems else "")
        ref_cell = f"{len(reference)} turns, {played[0].tool_calls} tool calls"
        report.episode_rows.append((_short(_prompt_text(item)), ref_cell, _fmt(scores[0]), wrong_cell))


def print_table(report: CheckReport, out: TextIO | None = None) -> None:
    _print_rows(report.rows, ("prompt", "reference", "ref reward", "wrong-answer rewards"), out)
    if report.episode_rows:
        print(file=out or sys.stdout)
        header = ("prompt", "reference episode", "ref reward", "wrong-episode rewards")
        _print_rows(report.episode_rows, header, out)


def _print_rows(
    rows_in: list[tuple[str, str, str, str]], header: tuple[str, ...], out: TextIO | None
) -> None:
    out = out or sys.stdout
    rows = [header, *rows_in]
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
    episodes = f", {len(report.episode_rows)} scripted episode sets played" if report.episode_rows else ""
    print(
        f"\nOK: {len(report.rows)} prompts{episodes}, references score >= threshold, wrong answers below it."
    )
    return 0
