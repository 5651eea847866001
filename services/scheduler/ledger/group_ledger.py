"""Tracks every prompt group through issued → generated → scored → trained (or dropped / filtered).

Transitions are checked, so a group can be neither lost (every issued group ends in exactly one
terminal state) nor trained twice. Every change of a record is handed to an optional sink: the
durable store (`store.py`) keeps the changed records and writes them to SQLite in batches, so this
in-memory ledger stays the fast path (microseconds per transition on the event loop) and a
restarted scheduler rebuilds it with `restore`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

from services.common.errors import FailedPrecondition, NotFound


class GroupState(StrEnum):
    ISSUED = "issued"
    GENERATED = "generated"
    SCORED = "scored"
    TRAINED = "trained"
    DROPPED = "dropped"
    FILTERED = "filtered"  # scored, but its rewards have zero variance: no gradient (dynamic sampling)


_NEXT = {
    GroupState.ISSUED: {GroupState.GENERATED, GroupState.DROPPED},
    GroupState.GENERATED: {GroupState.SCORED, GroupState.DROPPED, GroupState.FILTERED},
    GroupState.SCORED: {GroupState.TRAINED, GroupState.DROPPED},
    GroupState.TRAINED: set(),
    GroupState.DROPPED: set(),
    GroupState.FILTERED: set(),
}
TERMINAL = frozenset({GroupState.TRAINED, GroupState.DROPPED, GroupState.FILTERED})


@dataclass(slots=True)
class GroupRecord:
    group_id: str
    prompt_id: str
    attempt: int
    issued_version: int
    position: int = -1  # the prompt's position in the env's train stream (-1: not from the stream)
    state: GroupState = GroupState.ISSUED
    rollout_id: str = ""
    reason: str = ""
    reissue: bool = False  # dropped, and its prompt goes back to the queue (a later attempt)
    versions: tuple[int, ...] = ()  # weight versions that produced its tokens (once generated)
    generation: int = 0  # the learner lineage generation it was issued in (a rewind starts a new one)
    issued_at: float = 0.0
    updated_at: float = 0.0


class GroupLedger:
    """In-memory ledger of prompt groups, keyed by group id."""

    def __init__(self, sink: Callable[[GroupRecord], None] | None = None) -> None:
        self._groups: dict[str, GroupRecord] = {}
        self._counts: Counter[GroupState] = Counter()
        self._open = 0  # issued, not yet trained, dropped or filtered
        self._attempts: dict[str, int] = {}
        self._sink = sink

    def issue(
        self, prompt_id: str, version: int, position: int = -1, generation: int = 0, rollout_id: str = ""
    ) -> GroupRecord:
        """A new group for `prompt_id` (sent to `rollout_id`); re-issuing a dropped prompt gets a new
        attempt number."""
        attempt = self._attempts.get(prompt_id, 0)
        self._attempts[prompt_id] = attempt + 1
        now = time.time()
        record = GroupRecord(
            f"{prompt_id}#{attempt}",
            prompt_id,
            attempt,
            version,
            position,
            rollout_id=rollout_id,
            generation=generation,
            issued_at=now,
        )
        self._groups[record.group_id] = record
        self._open += 1
        self._counts[GroupState.ISSUED] += 1
        self._changed(record, now)
        return record

    def advance(
        self,
        group_id: str,
        state: GroupState,
        reason: str = "",
        *,
        versions: Iterable[int] = (),
        reissue: bool = False,
    ) -> GroupRecord:
        record = self.get(group_id)
        if state not in _NEXT[record.state]:
            raise FailedPrecondition(f"group {group_id} cannot go from {record.state} to {state}")
        self._counts[record.state] -= 1
        self._counts[state] += 1
        if state in TERMINAL:
            self._open -= 1
        record.state, record.reason = state, reason or record.reason
        record.reissue = reissue
        if versions:
            record.versions = tuple(sorted(versions))
        self._changed(record, time.time())
        return record

    def restore(self, records: Iterable[GroupRecord]) -> None:
        """Load the records of an earlier incarnation (a restarted scheduler); none is re-emitted."""
        for record in records:
            self._groups[record.group_id] = record
            self._counts[record.state] += 1
            if record.state not in TERMINAL:
                self._open += 1
            self._attempts[record.prompt_id] = max(
                self._attempts.get(record.prompt_id, 0), record.attempt + 1
            )

    def latest(self, prompt_id: str) -> GroupRecord | None:
        """The newest group issued for `prompt_id`, if any (restored records included)."""
        attempts = self._attempts.get(prompt_id, 0)
        return self._groups.get(f"{prompt_id}#{attempts - 1}") if attempts else None

    def get(self, group_id: str) -> GroupRecord:
        try:
            return self._groups[group_id]
        except KeyError as exc:
            raise NotFound(f"unknown group {group_id}") from exc

    def counts(self) -> dict[str, int]:
        return {state.value: self._counts[state] for state in GroupState}

    def in_pipeline(self) -> int:
        """Groups issued but not yet terminal (kept as a count: admission reads it per group)."""
        return self._open

    def records(self) -> list[GroupRecord]:
        return list(self._groups.values())

    def _changed(self, record: GroupRecord, now: float) -> None:
        record.updated_at = now
        if self._sink is not None:
            self._sink(record)
