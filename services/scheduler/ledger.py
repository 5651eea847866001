"""Tracks every prompt group through issued → generated → scored → trained (or dropped).

Transitions are checked, so a group can be neither lost (every issued group ends in exactly one
terminal state) nor trained twice. Each transition is also emitted as an event to an optional sink:
the in-memory ledger is shaped so a later change can make it durable by persisting those events.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from services.common.errors import FailedPrecondition, NotFound


class GroupState(StrEnum):
    ISSUED = "issued"
    GENERATED = "generated"
    SCORED = "scored"
    TRAINED = "trained"
    DROPPED = "dropped"


_NEXT = {
    GroupState.ISSUED: {GroupState.GENERATED, GroupState.DROPPED},
    GroupState.GENERATED: {GroupState.SCORED, GroupState.DROPPED},
    GroupState.SCORED: {GroupState.TRAINED, GroupState.DROPPED},
    GroupState.TRAINED: set(),
    GroupState.DROPPED: set(),
}
TERMINAL = frozenset({GroupState.TRAINED, GroupState.DROPPED})


@dataclass(slots=True)
class GroupRecord:
    group_id: str
    prompt_id: str
    attempt: int
    issued_version: int
    state: GroupState = GroupState.ISSUED
    rollout_id: str = ""
    reason: str = ""
    history: list[tuple[GroupState, float]] = field(default_factory=list)


@dataclass(frozen=True)
class LedgerEvent:
    group_id: str
    prompt_id: str
    state: GroupState
    at: float
    reason: str = ""


class GroupLedger:
    """In-memory ledger of prompt groups, keyed by group id."""

    def __init__(self, sink: Callable[[LedgerEvent], None] | None = None) -> None:
        self._groups: dict[str, GroupRecord] = {}
        self._counts: Counter[GroupState] = Counter()
        self._open = 0  # issued, not yet trained or dropped
        self._attempts: Counter[str] = Counter()
        self._sink = sink

    def issue(self, prompt_id: str, version: int) -> GroupRecord:
        """A new group for `prompt_id`; re-issuing a dropped prompt gets a new attempt number."""
        attempt = self._attempts.get(prompt_id, 0)
        self._attempts[prompt_id] = attempt + 1
        record = GroupRecord(f"{prompt_id}#{attempt}", prompt_id, attempt, version)
        self._groups[record.group_id] = record
        self._open += 1
        self._record(record, GroupState.ISSUED, "")
        return record

    def advance(self, group_id: str, state: GroupState, reason: str = "") -> GroupRecord:
        record = self.get(group_id)
        if state not in _NEXT[record.state]:
            raise FailedPrecondition(f"group {group_id} cannot go from {record.state} to {state}")
        self._counts[record.state] -= 1
        if state in TERMINAL:
            self._open -= 1
        self._record(record, state, reason)
        return record

    def get(self, group_id: str) -> GroupRecord:
        try:
            return self._groups[group_id]
        except KeyError as exc:
            raise NotFound(f"unknown group {group_id}") from exc

    def counts(self) -> dict[str, int]:
        return {state.value: self._counts[state] for state in GroupState}

    def in_pipeline(self) -> int:
        """Groups issued but neither trained nor dropped (kept as a count: admission reads it per group)."""
        return self._open

    def records(self) -> list[GroupRecord]:
        return list(self._groups.values())

    def _record(self, record: GroupRecord, state: GroupState, reason: str) -> None:
        now = time.time()
        record.state, record.reason = state, reason or record.reason
        record.history.append((state, now))
        self._counts[state] += 1
        if self._sink is not None:
            self._sink(LedgerEvent(record.group_id, record.prompt_id, state, now, reason))
