"""The durable ledger: every group's life, every batch and every training, in SQLite (WAL) in the run dir.

`<run_dir>/ledger.sqlite` is what a restarted scheduler recovers from (`recovery.py`) and what the
audit reads (`audit.py`). Tables:

    meta       run id, learner lineage, the run's B / G / max_staleness, scheduler incarnations
    prompts    position → the Prompt message served at that position of the env's train stream
    groups     one row per group attempt: position, state, issued version, rollout, the weight
               versions that produced it, why it was dropped and whether its prompt was re-issued
    scored     group id → its scored completions (a ScoredGroup message) and rewards (float64 JSON),
               so a scored group never needs regenerating
    batches    step → batch id, the learner version it trains at, its group ids (immutable)
    trainings  one row per acknowledged optimizer step: step, batch, version after, learner instance
               and lineage generation (a learner restart rewinds and re-trains: several rows per step)
    learner_logprobs  group id → the step that trained it and the learner's logprob of each of its
               completions' tokens (a GroupLogprobs message; `token_scores.py` reads them)
    events     scheduler starts, learner restarts and rewinds, recoveries (JSON detail)
    level_outcomes  an env with difficulty levels: each scored group's level and how many of its
               completions were solved, in scoring order (the curriculum's rates are rebuilt from it)

Writes never block the event loop: changes are queued in memory (a dict of changed records, a list
of rows) and written in one transaction on the store's own thread, periodically and before every
train step (`commit_batch` awaits durability: a batch is on disk before the learner sees it, so its
id always names the same groups). Serializing a scored group (O(tokens)) happens on that thread too.
synchronous=FULL: a commit survives a kill -9 of the scheduler and a power loss.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo.common.v1 import types_pb2
from services.common.logging import get_logger
from services.scheduler.ledger import token_scores
from services.scheduler.ledger.group_ledger import GroupRecord, GroupState
from services.scheduler.peers.clients import ScoredGroup

log = get_logger(__name__)

FILE_NAME = "ledger.sqlite"
SCHEMA_VERSION = "1"

_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS prompts (position INTEGER PRIMARY KEY, prompt BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT PRIMARY KEY, prompt_id TEXT NOT NULL, attempt INTEGER NOT NULL,
    position INTEGER NOT NULL, state TEXT NOT NULL, issued_version INTEGER NOT NULL,
    rollout_id TEXT NOT NULL, reason TEXT NOT NULL, reissue INTEGER NOT NULL,
    versions TEXT NOT NULL, generation INTEGER NOT NULL, issued_at REAL NOT NULL,
    updated_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS groups_by_position ON groups (position);
CREATE TABLE IF NOT EXISTS scored (group_id TEXT PRIMARY KEY, payload BLOB NOT NULL, rewards TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    step INTEGER PRIMARY KEY, batch_id TEXT NOT NULL UNIQUE, train_version INTEGER NOT NULL,
    group_ids TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS trainings (
    id INTEGER PRIMARY KEY AUTOINCREMENT, step INTEGER NOT NULL, batch_id TEXT NOT NULL,
    version_after INTEGER NOT NULL, learner_instance TEXT NOT NULL, generation INTEGER NOT NULL,
    at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, at REAL NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS level_outcomes (
    id INTEGER PRIMARY KEY AUTOINCREMENT, group_id TEXT NOT NULL, level TEXT NOT NULL,
    solved INTEGER NOT NULL, total INTEGER NOT NULL);
"""
    + token_scores.TABLE_SCHEMA
)


@dataclass(frozen=True)
class BatchRow:
    step: int
    batch_id: str
    train_version: int
    group_ids: tuple[str, ...]


@dataclass(frozen=True)
class TrainingRow:
    id: int
    step: int
    batch_id: str
    version_after: int
    learner_instance: str
    generation: int


@dataclass
class Snapshot:
    """Everything the ledger holds, as read back (recovery and the audit work on this, not on SQL)."""

    meta: dict[str, str] = field(default_factory=dict)
    groups: list[GroupRecord] = field(default_factory=list)
    batches: dict[int, BatchRow] = field(default_factory=dict)
    trainings: list[TrainingRow] = field(default_factory=list)
    scored_ids: set[str] = field(default_factory=set)
    events: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    level_outcomes: list[tuple[str, int, int]] = field(default_factory=list)  # (level, solved, total)

    @property
    def empty(self) -> bool:
        return not self.groups and not self.batches

    def next_position(self) -> int:
        """The first train-stream position no group has taken yet."""
        return max((g.position for g in self.groups), default=-1) + 1


def _group_row(r: GroupRecord) -> tuple:
    versions = ",".join(map(str, r.versions))
    return (
        r.group_id, r.prompt_id, r.attempt, r.position, r.state.value, r.issued_version, r.rollout_id,
        r.reason, int(r.reissue), versions, r.generation, r.issued_at, r.updated_at,
    )  # fmt: skip


def _scored_row(group: ScoredGroup) -> tuple[str, bytes, str]:
    """(id, ScoredGroup bytes, rewards JSON): rewards kept as float64, so a re-trained batch gets
    exactly the advantages it had (the proto's rewards are float32)."""
    message = types_pb2.ScoredGroup(
        group_id=group.group_id,
        prompt=group.prompt,
        completions=group.completions,
        reward_infos=group.reward_infos,
        prompt_token_ids=group.prompt_token_ids,
        sampling_params=group.sampling_params,
        rollout_id=group.rollout_id,
    )
    return group.group_id, message.SerializeToString(), json.dumps(list(group.rewards))


class LedgerStore:
    """The SQLite ledger of one run directory; every SQL statement runs on the store's own thread."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / FILE_NAME
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._db: sqlite3.Connection | None = None
        self._groups: dict[str, GroupRecord] = {}  # changed since the last flush
        self._prompts: list[tuple[int, types_pb2.Prompt]] = []
        self._scored: list[ScoredGroup] = []
        self._logprobs: list[tuple[int, list[tuple[str, token_scores.GroupScores]]]] = []
        self._rows: list[tuple[str, tuple]] = []  # (statement, parameters), in order
        self.flushes = 0
        self.flush_seconds = 0.0  # time spent writing, on the store's thread (not the event loop)

    # ---- opening and reading ----------------------------------------------------------------------

    async def open(self) -> Snapshot:
        """Open (creating it if needed) and read everything back."""
        return await self._call(self._open)

    def _open(self) -> Snapshot:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        db.executescript(_SCHEMA)
        self._db = db
        return read_snapshot(db)

    # ---- queued writes (called on the event loop: O(1) each) ----------------------------------------

    def group_changed(self, record: GroupRecord) -> None:
        """The ledger's sink: the record's latest state is written at the next flush."""
        self._groups[record.group_id] = record

    def prompt_issued(self, position: int, prompt: types_pb2.Prompt) -> None:
        self._prompts.append((position, prompt))

    def scored(self, group: ScoredGroup) -> None:
        self._scored.append(group)

    def level_outcome(self, group_id: str, level: str, solved: int, total: int) -> None:
        """A scored group of a leveled env: `solved` of its `total` completions (pipeline/curriculum.py)."""
        self._rows.append((
            "INSERT INTO level_outcomes (group_id, level, solved, total) VALUES (?, ?, ?, ?)",
            (group_id, level, solved, total),
        ))  # fmt: skip

    def trained(self, step: int, batch_id: str, version_after: int, instance: str, generation: int) -> None:
        self._rows.append((
            "INSERT INTO trainings (step, batch_id, version_after, learner_instance, generation, at) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (step, batch_id, version_after, instance, generation, time.time()),
        ))  # fmt: skip

    def learner_logprobs(
        self, step: int, groups: Sequence[ScoredGroup], completions: Sequence[Sequence[float]]
    ) -> None:
        """The learner's logprobs of step `step`'s batch (`completions`, in the batch's order: its
        `groups` in order, each group's completions in order), one row per group; written at the next
        flush, replacing what an earlier training of the group wrote. An answer without any (a retry
        answered from a resumed checkpoint) leaves the rows as they are, and so does one that does not
        match the batch (logged: a viewer's figures never stop a run)."""
        if not completions:
            return
        counts = [(g.group_id, len(g.completions)) for g in groups]
        try:
            self._logprobs.append((step, token_scores.split_by_group(counts, completions)))
        except ValueError as exc:
            log.warning("learner logprobs not recorded", step=step, error=str(exc))

    def event(self, kind: str, **detail: Any) -> None:
        self._rows.append((
            "INSERT INTO events (kind, at, detail) VALUES (?, ?, ?)",
            (kind, time.time(), json.dumps(detail, sort_keys=True)),
        ))  # fmt: skip

    def set_meta(self, **values: object) -> None:
        for key, value in values.items():
            self._rows.append(("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, str(value))))

    @property
    def dirty(self) -> bool:
        return bool(self._groups or self._prompts or self._scored or self._rows or self._logprobs)

    # ---- durable points -----------------------------------------------------------------------------

    async def commit_batch(self, batch: BatchRow) -> None:
        """Write everything queued and the batch in one transaction; returns once it is on disk."""
        self._rows.append((
            "INSERT OR IGNORE INTO batches (step, batch_id, train_version, group_ids, created_at) "
            "VALUES (?, ?, ?, ?, ?)",
            (batch.step, batch.batch_id, batch.train_version, json.dumps(list(batch.group_ids)), time.time()),
        ))  # fmt: skip
        await self.flush()

    async def flush(self) -> None:
        """Write everything queued so far in one transaction, on the store's thread."""
        if not self.dirty:
            return
        # What changed is taken now, on the loop (cheap: a row tuple per changed group); the O(tokens)
        # serialization of scored groups and the SQL run on the store's thread.
        groups = [_group_row(r) for r in self._groups.values()]
        prompts, scored, rows, logprobs = self._prompts, self._scored, self._rows, self._logprobs
        self._groups, self._prompts, self._scored, self._rows, self._logprobs = {}, [], [], [], []
        # The rows are off the queues now: a flusher cancelled while waiting (the run ending) must not
        # cancel their write, or a write still queued on the store's thread would be dropped. The
        # single-thread executor runs it before `close` closes the database.
        await asyncio.shield(self._call(lambda: self._write(groups, prompts, scored, rows, logprobs)))

    def _write(
        self,
        groups: list[tuple],
        prompts: list[tuple[int, types_pb2.Prompt]],
        scored: list[ScoredGroup],
        rows: list[tuple[str, tuple]],
        logprobs: list[tuple[int, list[tuple[str, token_scores.GroupScores]]]],
    ) -> None:
        started = time.perf_counter()
        db = self._connection()
        with _transaction(db):
            db.executemany(
                "INSERT OR IGNORE INTO prompts (position, prompt) VALUES (?, ?)",
                [(position, p.SerializeToString()) for position, p in prompts],
            )
            db.executemany(
                "INSERT OR REPLACE INTO scored (group_id, payload, rewards) VALUES (?, ?, ?)",
                [_scored_row(g) for g in scored],
            )
            db.executemany(
                "INSERT OR REPLACE INTO groups VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", groups
            )
            for statement, parameters in rows:
                db.execute(statement, parameters)
            db.executemany(  # serialized here, on the store's thread (O(tokens))
                token_scores.INSERT,
                [token_scores.encode(gid, step, lps) for step, groups in logprobs for gid, lps in groups],
            )
        self.flushes += 1
        self.flush_seconds += time.perf_counter() - started

    # ---- reads a recovering scheduler needs ---------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        """Everything written so far, read back on the store's thread."""
        return await self._call(lambda: read_snapshot(self._connection()))

    async def load_scored(self, group_ids: Iterable[str]) -> dict[str, ScoredGroup]:
        """The stored scored groups (parsed on the store's thread)."""
        wanted = list(group_ids)
        return await self._call(lambda: load_scored(self._connection(), wanted))

    async def load_prompts(self, positions: Iterable[int]) -> dict[int, types_pb2.Prompt]:
        wanted = list(positions)
        return await self._call(lambda: load_prompts(self._connection(), wanted))

    async def close(self) -> None:
        """Write what is queued and close the database."""
        try:
            if self._db is not None:
                await self.flush()
                await self._call(self._db.close)
        finally:
            self._db = None
            self._executor.shutdown(wait=False)

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError("ledger store is not open")
        return self._db

    async def _call(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)


class _transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, value, traceback) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


def read_snapshot(db: sqlite3.Connection) -> Snapshot:
    """Everything in an open ledger database (no payloads: those are read on demand)."""
    snapshot = Snapshot(meta=dict(db.execute("SELECT key, value FROM meta")))
    for row in db.execute("SELECT * FROM groups ORDER BY issued_at, group_id"):
        (gid, prompt_id, attempt, position, state, version, rollout, reason, reissue, versions, generation,
         issued_at, updated_at) = row  # fmt: skip
        snapshot.groups.append(
            GroupRecord(
                gid,
                prompt_id,
                attempt,
                version,
                position,
                GroupState(state),
                rollout,
                reason,
                bool(reissue),
                tuple(int(v) for v in versions.split(",") if v),
                generation,
                issued_at,
                updated_at,
            )
        )
    for step, batch_id, train_version, group_ids, _ in db.execute("SELECT * FROM batches ORDER BY step"):
        snapshot.batches[step] = BatchRow(step, batch_id, train_version, tuple(json.loads(group_ids)))
    for row in db.execute(
        "SELECT id, step, batch_id, version_after, learner_instance, generation FROM trainings ORDER BY id"
    ):
        snapshot.trainings.append(TrainingRow(*row))
    snapshot.scored_ids = {gid for (gid,) in db.execute("SELECT group_id FROM scored")}
    for kind, at, detail in db.execute("SELECT kind, at, detail FROM events ORDER BY id"):
        snapshot.events.append((kind, at, json.loads(detail)))
    if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'level_outcomes'").fetchone():  # older ledgers
        snapshot.level_outcomes = list(
            db.execute("SELECT level, solved, total FROM level_outcomes ORDER BY id")
        )
    return snapshot


def load_scored(db: sqlite3.Connection, group_ids: list[str]) -> dict[str, ScoredGroup]:
    found: dict[str, ScoredGroup] = {}
    for gid in group_ids:
        row = db.execute("SELECT payload, rewards FROM scored WHERE group_id = ?", (gid,)).fetchone()
        if row is None:
            continue
        message = types_pb2.ScoredGroup.FromString(row[0])
        completions = list(message.completions)
        versions = {span.version for c in completions for span in c.version_spans}
        found[gid] = ScoredGroup(
            gid, message.prompt, completions, json.loads(row[1]), list(message.reward_infos), versions,
            prompt_token_ids=list(message.prompt_token_ids),
            sampling_params=message.sampling_params if message.HasField("sampling_params") else None,
            rollout_id=message.rollout_id,
        )  # fmt: skip
    return found


def load_prompts(db: sqlite3.Connection, positions: list[int]) -> dict[int, types_pb2.Prompt]:
    found = {}
    for position in positions:
        row = db.execute("SELECT prompt FROM prompts WHERE position = ?", (position,)).fetchone()
        if row is not None:
            found[position] = types_pb2.Prompt.FromString(row[0])
    return found


def read_ledger(run_dir: Path) -> Snapshot:
    """Read a run directory's ledger (read-only; for the audit and tools)."""
    path = run_dir / FILE_NAME
    if not path.exists():
        raise FileNotFoundError(f"no ledger at {path}")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return read_snapshot(db)
    finally:
        db.close()
