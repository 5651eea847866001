"""The soak's checks on a recorded run (bench/soak.py): pure functions of `metrics.jsonl` rows and the
faults as they were injected, so they can be tested without running anything.

Step rows are the rows with `reward_mean` that are neither eval-only nor events (a re-trained step
after a learner rewind and a `recovered` step are step rows too); their `time` (the scheduler's
`time.time()` when it wrote the row) is when the step completed. The soak records its faults with
the same clock.

The stall of a fault: the longest gap between consecutive completed steps that overlaps the fault's
window (a freeze: SIGSTOP to SIGCONT; a kill: the minute after it was sent), minus the median step
interval of the 20 steps before the fault (the run's pace just then; floored at 0). The run's end
(the launcher's exit) closes the last gap, so a run that never trained again after a fault shows its
whole remaining time as the stall. Bounds: a frozen
env, learner or scheduler stalls training at most its freeze + `slack` seconds; a frozen rollout at
most `slack` seconds (the other rollouts carry on); a kill is reported, not judged.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLLOUT_PREFIX = "rollout"
BASELINE_STEPS = 20  # step intervals before a fault that set its baseline pace


def read_rows(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's rows (a half-written last line is skipped); [] when there is no file yet."""
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


def is_step_row(row: dict[str, Any]) -> bool:
    return "reward_mean" in row and not row.get("eval_only") and "event" not in row


def step_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if is_step_row(r)]


def step_times(rows: Sequence[dict[str, Any]]) -> list[float]:
    """When each step completed (row order is write order, so re-trained steps appear twice)."""
    return sorted(float(r["time"]) for r in step_rows(rows) if "time" in r)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


def check_steps_done(rows: Sequence[dict[str, Any]], steps: int) -> Check:
    done = max((int(r["weight_version"]) for r in step_rows(rows)), default=0)
    return Check("all steps done", done >= steps, f"last step row at version {done} of {steps}")


def check_versions(rows: Sequence[dict[str, Any]], steps: int) -> Check:
    """Versions +1 per step row from version 1; a `learner_rewind` row restarts the count after the
    version it names (the surviving lineage); the lineage must end at version `steps`."""
    expected, rewinds = 1, 0
    for row in rows:
        if row.get("event") == "learner_rewind":
            expected = int(row["weight_version"]) + 1
            rewinds += 1
        elif is_step_row(row):
            if row.get("weight_version") != expected:
                return Check(
                    "versions +1 per step",
                    False,
                    f"row of step {row.get('step')} has version {row.get('weight_version')}, expected "
                    f"{expected} (after {rewinds} rewind(s))",
                )
            expected += 1
    ok = expected == steps + 1
    return Check("versions +1 per step", ok, f"lineage ends at version {expected - 1} ({rewinds} rewind(s))")


def check_alignment(rows: Sequence[dict[str, Any]], limit: float) -> Check:
    """Every measured probe is ≤ `limit`, and at least one step was measured. A null is a probe no
    rollout answered (all down at that sync: expected under faults), counted as skipped; rows without
    the field (a `recovered` step) are not counted."""
    values = [r["logprob_abs_diff_max"] for r in step_rows(rows) if "logprob_abs_diff_max" in r]
    measured = [v for v in values if v is not None]
    bad = [v for v in measured if not v <= limit]
    worst = max((v for v in measured if math.isfinite(v)), default=float("nan"))
    skipped = len(values) - len(measured)
    detail = f"max {worst:.3g} over {len(measured)} rows, {skipped} skipped (limit {limit:g})"
    if bad:
        detail += f"; {len(bad)} row(s) over, e.g. {bad[0]}"
    return Check("alignment", bool(measured) and not bad, detail if measured else "no row measured it")


def median_interval(times: Sequence[float]) -> float:
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else 0.0


def longest_gap(times: Sequence[float], start: float, end: float, run_end: float) -> float:
    """The longest gap between consecutive completed steps (the run's end closing the last one) that
    overlaps [start, end]; 0 when no step completed before `end`."""
    points = sorted([*(t for t in times if t <= run_end), run_end])
    longest = 0.0
    for a, b in itertools.pairwise(points):
        if a <= end and b >= start:
            longest = max(longest, b - a)
    return longest


def bound(service: str, kind: str, freeze_s: float, slack: float) -> float | None:
    """The most a fault may stall training; None for a kill (reported only)."""
    if kind != "freeze":
        return None
    return slack if service.startswith(ROLLOUT_PREFIX) else freeze_s + slack


def baseline_interval(times: Sequence[float], before: float, window: int = BASELINE_STEPS) -> float:
    """The median step interval over the last `window` steps completed before `before` (the pace just
    before a fault, so a machine whose load changes during the run is compared with itself); the whole
    run's median when fewer than 3 intervals precede it."""
    earlier = [t for t in times if t <= before][-(window + 1) :]
    return median_interval(earlier) if len(earlier) > 3 else median_interval(times)


KILL_WINDOW_S = 60.0  # how long after a kill its stall is looked for (kills are reported, not judged)


def judge_faults(
    faults: Sequence[dict[str, Any]], times: Sequence[float], run_end: float, slack: float
) -> list[dict[str, Any]]:
    """Each injected fault (`service`, `kind`, `start`, `end`, `freeze_s`) with its `stall_s`, `bound_s`,
    `verdict` (ok, FAIL, report) and the `baseline_s` step interval its stall is measured against."""
    judged = []
    for fault in faults:
        # a kill's cost shows after it: the rows of steps trained before it are still being written,
        # and the replacement's start (and a learner's rewind) come later
        end = fault["end"] + (KILL_WINDOW_S if fault["kind"] == "kill" else 0.0)
        gap = longest_gap(times, fault["start"], end, run_end)
        median = baseline_interval(times, fault["start"])
        stall = max(0.0, gap - median)
        limit = bound(fault["service"], fault["kind"], fault["freeze_s"], slack)
        verdict = "report" if limit is None else ("ok" if stall <= limit else "FAIL")
        judged.append(
            {**fault, "stall_s": round(stall, 2), "baseline_s": round(median, 3), "bound_s": limit,
             "verdict": verdict}
        )  # fmt: skip
    return judged


def check_stalls(judged: Sequence[dict[str, Any]]) -> Check:
    bounded = [f for f in judged if f["bound_s"] is not None]
    over = [f for f in bounded if f["verdict"] != "ok"]
    detail = f"{len(bounded) - len(over)} of {len(bounded)} freezes within their bound"
    if over:
        detail += "; over: " + ", ".join(
            f"{f['service']} {f['stall_s']:.1f}s > {f['bound_s']:.1f}s" for f in over
        )
    return Check("stalls within bounds", not over, detail)


def table(judged: Sequence[dict[str, Any]], first_step: float) -> str:
    """The faults table: when (seconds after the first step), what, how long, the step interval before
    it (pace), the stall and the verdict."""
    head = f"{'t (s)':>8}  {'service':<10} {'kind':<6} {'freeze (s)':>10} {'pace (s)':>8} {'stall (s)':>9}"
    head += f" {'bound (s)':>9}"
    lines = [f"{head}  verdict"]
    for f in judged:
        limit = "-" if f["bound_s"] is None else f"{f['bound_s']:.1f}"
        freeze = f"{f['freeze_s']:.1f}" if f["kind"] == "freeze" else "-"
        lines.append(
            f"{f['start'] - first_step:>8.1f}  {f['service']:<10} {f['kind']:<6} {freeze:>10} "
            f"{f['baseline_s']:>8.2f} {f['stall_s']:>9.1f} {limit:>9}  {f['verdict']}"
        )
    return "\n".join(lines)


def audit_counts(stdout: str) -> dict[str, str]:
    """`grpo-mesh audit`'s summary lines (`  key  value`) as a dict."""
    counts = {}
    for line in stdout.splitlines():
        parts = line.split()
        if line.startswith("  ") and len(parts) == 2:
            counts[parts[0]] = parts[1]
    return counts


def check_audit(returncode: int, stdout: str, steps: int) -> Check:
    counts = audit_counts(stdout)
    verdicts = [line for line in stdout.splitlines() if line.startswith("audit:")]
    last = verdicts[-1] if verdicts else "(no verdict line)"
    ok = returncode == 0 and counts.get("steps") == str(steps)
    return Check("audit", ok, f"exit {returncode}, steps {counts.get('steps', '?')} of {steps}: {last}")
