"""The learner's per-token logprobs of every trained group, as the ledger keeps them, and their reader.

Each TrainStep answers with the learner's logprob of every completion token of its batch (under the
weights the step started from: `TrainStepResponse.completion_logprobs`). The scheduler writes them per
group into the ledger's `learner_logprobs` table (`LedgerStore.learner_logprobs`), one row per group
id, its payload a `GroupLogprobs` message, completions in `ScoredGroup.completions`' order, so a viewer
joins them with `scored` by group id and completion index (and sets them beside the rollout's
behaviour logprobs, `Completion.logprobs`). A batch trained again (a learner restart's replay)
replaces its groups' rows.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from pathlib import Path

from grpo.common.v1 import types_pb2

TABLE_SCHEMA = """
CREATE TABLE IF NOT EXISTS learner_logprobs (
    group_id TEXT PRIMARY KEY, step INTEGER NOT NULL, payload BLOB NOT NULL);
"""
INSERT = "INSERT OR REPLACE INTO learner_logprobs (group_id, step, payload) VALUES (?, ?, ?)"

# One group's logprobs: per completion, per completion token.
GroupScores = Sequence[Sequence[float]]


def split_by_group(
    counts: Sequence[tuple[str, int]], completions: Sequence[Sequence[float]]
) -> list[tuple[str, GroupScores]]:
    """A batch's per-completion logprobs (batch order) cut into its groups' ((group id, completions)
    in batch order); ValueError when the counts do not add up to the completions."""
    if sum(n for _, n in counts) != len(completions):
        raise ValueError(
            f"{len(completions)} completions' logprobs for a batch of {sum(n for _, n in counts)}"
        )
    out, at = [], 0
    for group_id, n in counts:
        out.append((group_id, completions[at : at + n]))
        at += n
    return out


def encode(group_id: str, step: int, completions: GroupScores) -> tuple[str, int, bytes]:
    """A `learner_logprobs` row: (group id, step, serialized GroupLogprobs)."""
    message = types_pb2.GroupLogprobs(group_id=group_id, step=step)
    for logprobs in completions:
        message.completions.add().logprobs.extend(logprobs)
    return group_id, step, message.SerializeToString()


def decode(payload: bytes) -> list[list[float]]:
    """A row's payload back as per-completion lists of floats."""
    message = types_pb2.GroupLogprobs.FromString(payload)
    return [list(c.logprobs) for c in message.completions]


def read_learner_logprobs(path: Path | str, group_ids: Iterable[str]) -> dict[str, list[list[float]]]:
    """{group id: [[logprob per completion token] per completion]} for those of `group_ids` the ledger
    at `path` (a `ledger.sqlite`) has logprobs for; opened read-only. A ledger written before the
    table existed has none: {}."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        exists = db.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'learner_logprobs'"
        ).fetchone()
        if exists is None:
            return {}
        found: dict[str, list[list[float]]] = {}
        for gid in dict.fromkeys(group_ids):
            row = db.execute("SELECT payload FROM learner_logprobs WHERE group_id = ?", (gid,)).fetchone()
            if row is not None:
                found[gid] = decode(row[0])
        return found
    finally:
        db.close()
