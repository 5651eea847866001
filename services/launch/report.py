"""Summaries and plots of a finished run, from `<run_dir>/metrics.jsonl`."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_row(run_dir: Path, tail_bytes: int = 8192) -> dict[str, Any] | None:
    """The newest metrics row, reading only the end of the file (cheap enough to poll every second)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    with path.open("rb") as handle:
        handle.seek(max(0, path.stat().st_size - tail_bytes))
        lines = [line for line in handle.read().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:  # a line cut by the tail window or still being written
        return None


def step_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of trained steps with their full metrics (not eval-only rows, not recovery events, not
    the bare row of a step a restarted scheduler found trained but unrecorded)."""
    return [r for r in rows if "logprob_abs_diff_max" in r and not r.get("eval_only")]


def versions_advance_by_one(rows: list[dict[str, Any]]) -> bool:
    """Each step row is one version past the previous one; a learner rewind row resets the count."""
    expected = None
    for row in rows:
        if row.get("event") == "learner_rewind":
            expected = row["weight_version"] + 1
        elif "reward_mean" in row and not row.get("eval_only"):
            if expected is not None and row["weight_version"] != expected:
                return False
            expected = row["weight_version"] + 1
    return True


def summarize(rows: list[dict[str, Any]], window: int = 5) -> dict[str, Any]:
    """Before/after reward (mean of the first/last `window` steps), eval accuracy, speed and sync numbers."""
    steps = step_rows(rows)
    if not steps:
        return {"steps": 0}
    evals = [r for r in rows if "eval/accuracy" in r]
    med = lambda key: statistics.median(r[key] for r in steps if r.get(key) is not None)  # noqa: E731
    summary = {
        "steps": len(steps),
        "reward_first": statistics.fmean(r["reward_mean"] for r in steps[:window]),
        "reward_last": statistics.fmean(r["reward_mean"] for r in steps[-window:]),
        "tokens_per_s_median": med("tokens_per_s"),
        "sync_ms_median": med("sync_ms"),
        "weight_transport": steps[-1].get("weight_transport"),
        # a null is a skipped probe (no rollout answered it), not an agreement
        "logprob_abs_diff_max": max(
            (r["logprob_abs_diff_max"] for r in steps if r["logprob_abs_diff_max"] is not None),
            default=None,
        ),
        "alignment_probes_skipped": sum(1 for r in steps if r["logprob_abs_diff_max"] is None),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in steps),
        "versions_advance_by_one": versions_advance_by_one(rows),
        "learner_rewinds": sum(1 for r in rows if r.get("event") == "learner_rewind"),
        "steps_retrained": sum(1 for r in steps if r.get("retrained")),
    }
    if evals:
        summary["eval_accuracy_first"] = evals[0]["eval/accuracy"]
        summary["eval_accuracy_last"] = evals[-1]["eval/accuracy"]
    episodes = [r for r in steps if "episode/turns_mean" in r]
    if episodes:  # a multi-turn task
        rate = lambda part: statistics.fmean(r["episode/tool_call_rate"] for r in part)  # noqa: E731
        summary["tool_call_rate_first"] = rate(episodes[:window])
        summary["tool_call_rate_last"] = rate(episodes[-window:])
        valid = lambda part: statistics.fmean(r.get("episode/valid_tool_call_rate", 0.0) for r in part)  # noqa: E731
        summary["valid_tool_call_rate_first"] = valid(episodes[:window])
        summary["valid_tool_call_rate_last"] = valid(episodes[-window:])
        summary["turns_mean"] = statistics.fmean(r["episode/turns_mean"] for r in episodes)
        summary["prefix_violations"] = max(r.get("episode/prefix_violations", 0) for r in episodes)
        env = [v for r in episodes if (v := r.get("logprob_abs_diff_max_env")) is not None]
        summary["logprob_abs_diff_max_env"] = max(env, default=None)  # the probe's environment tokens
    return summary


def plot_reward(rows: list[dict[str, Any]], out: Path) -> None:
    """reward.png: training reward per step (and eval accuracy where measured; a multi-turn task's
    tool-call rate too)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = step_rows(rows)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        [r["step"] for r in steps], [r["reward_mean"] for r in steps], label="train reward (mean)", lw=1.2
    )
    evals = [r for r in rows if "eval/accuracy" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="eval accuracy")
    episodes = [r for r in steps if "episode/tool_call_rate" in r]
    if episodes and any(r["episode/tool_call_rate"] for r in episodes):
        ax.plot(
            [r["step"] for r in episodes], [r["episode/tool_call_rate"] for r in episodes],
            label="tool-call rate", lw=1.0, ls="--",
        )  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward")
    ax.set_title("grpo-mesh run")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
