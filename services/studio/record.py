"""A run's durable record, read-only: the step rows of `metrics.jsonl` and the trained groups of
`ledger.sqlite`, for the studio's curves and trajectory pages. Works the same for a live run (the
scheduler is writing both files: the last, half-written line of metrics.jsonl is left for the next
read; the ledger is WAL, so a reader never blocks the writer) and for a finished or crashed one.

    metrics.jsonl   one JSON object per line: step rows, evaluation rows (`eval_only`), event rows
    ledger.sqlite   batches (step → group ids, train version), groups (issued version, state),
                    scored (group id → ScoredGroup message + float64 rewards), events;
                    learner_logprobs (group id → the learner's per-token logprobs when it trained it:
                    services/scheduler/ledger/token_scores.py)

The ledger's schema is documented in services/scheduler/ledger/store.py; this module reads it with
plain SQL on a read-only connection (`mode=ro`), and the payloads through the protobuf contracts.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo.common.v1 import types_pb2
from services.common.advantages import MODE_FOR_LOSS, LossKind, compute_advantages
from services.scheduler.ledger.token_scores import read_learner_logprobs

LEDGER = "ledger.sqlite"
METRICS = "metrics.jsonl"


@dataclass(frozen=True)
class Rows:
    """Complete metrics rows read from a byte offset, and the offset to read from next time."""

    rows: list[dict[str, Any]]
    offset: int


def finite(value: Any) -> Any:
    """JSON for a browser: NaN and ±inf become null (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_rows(run_dir: Path, offset: int = 0) -> Rows:
    """The complete lines of metrics.jsonl from byte `offset` on (a half-written last line stays for
    the next call). An offset past the end (a new run reusing the dir) starts over from 0."""
    path = run_dir / METRICS
    if not path.exists():
        return Rows([], 0)
    with path.open("rb") as f:
        f.seek(0, 2)
        if offset > f.tell():
            offset = 0
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append({k: finite(v) for k, v in row.items()})
    return Rows(rows, offset + end)


@contextmanager
def ledger(run_dir: Path) -> Iterator[sqlite3.Connection | None]:
    """A read-only connection to the run's ledger; None when there is none yet."""
    path = run_dir / LEDGER
    if not path.exists():
        yield None
        return
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
    try:
        yield db
    finally:
        db.close()


def _has_table(db: sqlite3.Connection, name: str) -> bool:
    row = db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone()
    return row is not None


@dataclass(frozen=True)
class StepSummary:
    step: int
    train_version: int
    groups: int
    reward_mean: float


def list_steps(run_dir: Path) -> list[StepSummary]:
    """Every batch the ledger holds, by step, with its mean reward."""
    with ledger(run_dir) as db:
        if db is None or not _has_table(db, "batches"):
            return []
        batches = db.execute("SELECT step, train_version, group_ids FROM batches ORDER BY step").fetchall()
        rewards = dict(db.execute("SELECT group_id, rewards FROM scored").fetchall())
    steps = []
    for step, version, group_ids in batches:
        ids = json.loads(group_ids)
        values = [r for g in ids if g in rewards for r in json.loads(rewards[g])]
        mean = sum(values) / len(values) if values else float("nan")
        steps.append(StepSummary(step, version, len(ids), mean))
    return steps


@dataclass
class Token:
    id: int
    text: str
    logprob: float  # the rollout's behaviour logprob (0 for an environment's token)
    version: int | None  # the weight version that sampled it; None for an environment's token
    learner_logprob: float | None = None  # the learner's, when it trained this completion


@dataclass
class CompletionView:
    index: int
    text: str
    reward: float
    advantage: float
    failure: str  # the scoring failure kind ("" = scored)
    parsed_answer: str
    staleness: int  # train version − the oldest version that sampled a token
    tokens: list[Token]
    turns: list[dict[str, Any]] = field(default_factory=list)  # multi-turn: source, start, end, reward
    max_abs_diff: float | None = None  # max |learner − rollout| over its sampled tokens


@dataclass
class GroupView:
    group_id: str
    step: int
    train_version: int
    prompt: str
    reference_answer: str
    rollout_id: str
    completions: list[CompletionView]


def _prompt_text(prompt: types_pb2.Prompt) -> str:
    if prompt.messages:
        return "\n".join(f"[{m.role}] {m.content}" for m in prompt.messages)
    return prompt.text


def _versions(completion: types_pb2.Completion) -> list[int | None]:
    """The weight version of each completion token (None where no span covers it: env tokens)."""
    out: list[int | None] = [None] * len(completion.completion_token_ids)
    for span in completion.version_spans:
        for i in range(span.start, min(span.end, len(out))):
            out[i] = span.version
    return out


def _advantage_mode(loss: str, configured: str) -> str:
    if configured and configured != "auto":
        return configured
    try:
        return MODE_FOR_LOSS[LossKind(loss)].value
    except ValueError:
        return "group_std"


def step_groups(
    run_dir: Path, step: int, decode: Any, loss: str = "grpo", mode: str = "auto"
) -> list[GroupView]:
    """The groups trained at `step`, with each completion's tokens (decoded by `decode(ids) → list of
    str`), reward, advantage (recomputed from the stored float64 rewards with the run's advantage mode),
    weight version per token, staleness, and the learner's logprobs where recorded."""
    with ledger(run_dir) as db:
        if db is None:
            return []
        batch = db.execute("SELECT train_version, group_ids FROM batches WHERE step = ?", (step,)).fetchone()
        if batch is None:
            return []
        train_version, joined = batch
        ids = json.loads(joined)
        marks = ",".join("?" * len(ids))
        scored = {
            gid: (payload, json.loads(rewards))
            for gid, payload, rewards in db.execute(
                f"SELECT group_id, payload, rewards FROM scored WHERE group_id IN ({marks})", ids
            )
        }
    learner = read_learner_logprobs(run_dir / LEDGER, ids)
    present = [g for g in ids if g in scored]
    advantages = compute_advantages([scored[g][1] for g in present], _advantage_mode(loss, mode))
    groups = []
    for gid, advs in zip(present, advantages, strict=True):
        message = types_pb2.ScoredGroup.FromString(scored[gid][0])
        rewards = scored[gid][1]
        ours = learner.get(gid, [])
        completions = []
        for i, c in enumerate(message.completions):
            versions = _versions(c)
            texts = decode(list(c.completion_token_ids))
            lp = ours[i] if i < len(ours) and len(ours[i]) == len(c.completion_token_ids) else None
            tokens = [
                Token(t, texts[k], c.logprobs[k] if k < len(c.logprobs) else 0.0, versions[k],
                      lp[k] if lp is not None else None)
                for k, t in enumerate(c.completion_token_ids)
            ]  # fmt: skip
            sampled = [v for v in versions if v is not None]
            diffs = [
                abs(t.learner_logprob - t.logprob)
                for t in tokens
                if t.version is not None and t.learner_logprob is not None
            ]
            info = message.reward_infos[i] if i < len(message.reward_infos) else types_pb2.RewardInfo(ok=True)
            completions.append(
                CompletionView(
                    index=c.index,
                    text=c.text,
                    reward=rewards[i] if i < len(rewards) else float("nan"),
                    advantage=advs[i],
                    failure="" if info.ok else (info.failure or "failed"),
                    parsed_answer=info.parsed_answer,
                    staleness=train_version - min(sampled) if sampled else 0,
                    tokens=tokens,
                    turns=[
                        {
                            "source": types_pb2.TurnSource.Name(t.source)
                            .removeprefix("TURN_SOURCE_")
                            .lower(),
                            "start": t.start,
                            "end": t.end,
                            "reward": t.reward if t.HasField("reward") else None,
                        }
                        for t in c.turns
                    ],
                    max_abs_diff=max(diffs) if diffs else None,
                )
            )
        groups.append(
            GroupView(
                group_id=gid,
                step=step,
                train_version=train_version,
                prompt=_prompt_text(message.prompt),
                reference_answer=message.prompt.reference_answer,
                rollout_id=message.rollout_id,
                completions=completions,
            )
        )
    return groups


def events(run_dir: Path, limit: int = 200) -> list[dict[str, Any]]:
    """The ledger's last `limit` events (scheduler starts, learner restarts and rewinds, recoveries, how
    the run ended), oldest first."""
    with ledger(run_dir) as db:
        if db is None or not _has_table(db, "events"):
            return []
        rows = db.execute("SELECT kind, at, detail FROM events ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
    return [{"kind": kind, "at": at, "detail": json.loads(detail)} for kind, at, detail in reversed(rows)]
