"""External groups in: what an external harness (an atropos env, a verifiers runner) generated through
the gateway and scored, taken into the run (`source = "external"`).

    gateway (trajectory API: each sequence matched to its generations)
        ──SubmitGroups──▶ intake ──scored──▶ batches

The harness draws its own tasks and drives the model through the gateway; the gateway matches every
sequence it submits to the generations it served, so each completion here carries the gateway's
tokens, behaviour logprobs and weight versions, never the harness's own. The intake then:

- takes a submission's groups all or nothing: RESOURCE_EXHAUSTED (nothing taken) while the trainer's
  bounded queue (`GroupPipeline.scored`, (max_staleness + 1) × B groups) lacks room for the new ones,
  so a flood is held back in the gateway, never queued without bound;
- acknowledges a group the ledger already holds (its `group_id` is its submission id) as DUPLICATE:
  a retried submission is never trained twice, across scheduler restarts too (the ledger restores the
  ids);
- records a group that would be older than the staleness bound by the time it trains (the groups
  taken before it train first: the dispatcher's own reckoning, `policy.expected_train_version`) as
  dropped (STALE), never trains it: what is accepted is trained;
- gives each accepted group the next train-stream position, exactly as a drawn prompt gets one, so the
  audit's exactly-once rules hold unchanged: issued, generated and scored at once, and answered only
  once the ledger has it on disk (a kill -9 after the answer loses nothing).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from grpo.common.v1 import types_pb2
from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from services.common.logging import get_logger
from services.scheduler.config import SchedulerSettings
from services.scheduler.ledger.group_ledger import GroupLedger, GroupState
from services.scheduler.ledger.store import LedgerStore
from services.scheduler.peers.clients import ScoredGroup
from services.scheduler.pipeline.groups import GroupPipeline
from services.scheduler.pipeline.policy import expected_train_version, span_versions

log = get_logger(__name__)

ACCEPTED, DUPLICATE, STALE = "accepted", "duplicate", "stale"


@dataclass(frozen=True)
class Verdict:
    kind: str  # ACCEPTED, DUPLICATE or STALE
    reason: str = ""


def check_group(group: types_pb2.ScoredGroup, size: int, where: str) -> None:
    """A submitted group is trainable as it stands: G completions, one finite reward each, every
    completion's tokens covered by logprobs and weight versions (what the gateway's matching builds)."""
    if not group.group_id:
        raise InvalidArgument(f"{where}: group_id (the submission id) is empty")
    n = len(group.completions)
    if n != size:
        raise InvalidArgument(f"{where}: {n} completions; this run's group size is {size}")
    if len(group.rewards) != n:
        raise InvalidArgument(f"{where}: {len(group.rewards)} rewards for {n} completions")
    if not all(math.isfinite(r) for r in group.rewards):
        raise InvalidArgument(f"{where}: rewards must be finite")
    for i, c in enumerate(group.completions):
        tokens = len(c.completion_token_ids)
        if tokens == 0 or len(c.logprobs) != tokens:
            raise InvalidArgument(f"{where}.completions[{i}]: {tokens} tokens, {len(c.logprobs)} logprobs")
        if not c.version_spans:
            raise InvalidArgument(f"{where}.completions[{i}]: no weight-version spans")
        if not (c.prompt_token_ids or group.prompt_token_ids):
            raise InvalidArgument(f"{where}.completions[{i}]: no prompt tokens")


class ExternalIntake:
    """SubmitGroups' side of the pipeline (`GroupPipeline.scored` is where accepted groups wait)."""

    def __init__(
        self,
        settings: SchedulerSettings,
        groups: GroupPipeline,
        ledger: GroupLedger,
        store: LedgerStore,
        version: Callable[[], int],
        generation: Callable[[], int],
    ) -> None:
        self._settings = settings
        self._groups, self._ledger, self._store = groups, ledger, store
        self._version, self._generation = version, generation
        self._open = asyncio.Event()  # set once the run is prepared (`open`)
        self._closed = False
        self._lock = asyncio.Lock()  # one submission at a time: capacity and positions stay exact
        self.first = asyncio.Event()  # set once a group was accepted (the probe is made from it)
        self.first_group: ScoredGroup | None = None
        self._queued: dict[str, ScoredGroup] = {}  # taken by the current submission, queued after the flush

    def open(self) -> None:
        """Take submissions from now on (the ledger is restored: positions continue where it ends)."""
        self._open.set()

    async def close(self) -> None:
        """The run is over (finished, failed or stopping): nothing more is taken, and a submission
        being written finishes first (the ledger closes after this)."""
        self._closed = True
        async with self._lock:
            pass

    def note_first(self, group: ScoredGroup) -> None:
        """A group the probe may be made from (a restart's requeued one)."""
        if self.first_group is None:
            self.first_group = group
            self.first.set()

    @property
    def capacity(self) -> int:
        return self._groups.scored.maxsize

    @property
    def waiting(self) -> int:
        return self._groups.scored.qsize()

    async def submit(self, groups: Sequence[types_pb2.ScoredGroup], source: str) -> list[Verdict]:
        """Take `groups` (checked first, all or nothing): each ACCEPTED (durable and queued), DUPLICATE
        or STALE. ResourceExhausted when the queue lacks room for the new ones."""
        size = self._settings.group_size
        for gi, group in enumerate(groups):
            check_group(group, size, f"groups[{gi}] ({group.group_id!r})")
        ids = [g.group_id for g in groups]
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a submission holds the same group_id twice")
        if self._closed:
            raise FailedPrecondition("the run is over (finished, failed or stopping): nothing more is "
                                     "trained; start a new run")  # fmt: skip
        if not self._open.is_set():
            raise Unavailable("the scheduler is preparing the run (restoring its ledger, syncing the "
                              "rollouts): retry shortly")  # fmt: skip
        async with self._lock:
            if self._closed:  # closed while this one waited for the lock
                raise FailedPrecondition("the run is over (finished, failed or stopping): nothing more "
                                         "is trained; start a new run")  # fmt: skip
            verdicts: list[Verdict | None] = []
            new = 0
            for group in groups:
                known = self._ledger.latest(group.group_id)
                if known is None:
                    verdicts.append(None)
                    new += 1
                elif known.state == GroupState.DROPPED:
                    verdicts.append(Verdict(STALE, known.reason))
                else:
                    verdicts.append(Verdict(DUPLICATE, f"already {known.state.value} as {known.group_id}"))
            room = self.capacity - self.waiting
            if new > room:
                raise ResourceExhausted(
                    f"the trainer's queue holds {self.waiting} of {self.capacity} groups: no room for "
                    f"{new} more; retry once a step has trained"
                )
            version = self._version()
            for group in groups:
                newest = max(span_versions(group.completions))
                if newest > version:
                    raise InvalidArgument(f"group {group.group_id!r} has tokens of version {newest}, "
                                          f"newer than the learner's {version}")  # fmt: skip
            for i, group in enumerate(groups):
                if verdicts[i] is None:
                    verdicts[i] = self._take(group, source, version)
            await self._store.flush()  # durable before the answer
        for verdict, group in zip(verdicts, groups, strict=True):
            if verdict is not None and verdict.kind == ACCEPTED:
                self._groups.scored.put_nowait(self._queued.pop(group.group_id))
        return [v for v in verdicts if v is not None]

    def _take(self, message: types_pb2.ScoredGroup, source: str, version: int) -> Verdict:
        """Record one new group in the ledger: accepted (scored, to be queued) or dropped as stale."""
        completions = list(message.completions)
        versions = span_versions(completions)
        # the version it will train at, the groups taken before it training first (as the dispatcher's
        # admission reckons): a group that would be stale by then is refused now, not dropped later
        batch = self._settings.groups_per_batch
        expected = expected_train_version(version, self._ledger.in_pipeline(), batch)
        position = self._groups.cursor
        self._groups.cursor += 1
        prompt = types_pb2.Prompt()
        prompt.CopyFrom(message.prompt)
        prompt.id, prompt.env_name = message.group_id, source
        record = self._ledger.issue(
            message.group_id, version, position, self._generation(), rollout_id=message.rollout_id
        )
        self._store.prompt_issued(position, prompt)
        self._ledger.advance(record.group_id, GroupState.GENERATED, versions=versions)
        age = expected - min(versions)
        if age > self._settings.max_staleness:
            reason = (
                f"stale by {age} versions by the time it would train (at v{expected}, its oldest token "
                f"v{min(versions)}; max_staleness {self._settings.max_staleness})"
            )
            self._ledger.advance(record.group_id, GroupState.DROPPED, reason)
            return Verdict(STALE, reason)
        self._ledger.advance(record.group_id, GroupState.SCORED)
        prompt_ids = list(message.prompt_token_ids)
        sampling = message.sampling_params if message.HasField("sampling_params") else None
        infos = list(message.reward_infos) or [types_pb2.RewardInfo(ok=True) for _ in completions]
        group = ScoredGroup(
            record.group_id, prompt, completions, [float(r) for r in message.rewards], infos, versions,
            {}, prompt_ids, sampling, message.rollout_id,
        )  # fmt: skip
        self._store.scored(group)
        self._groups.tokens.add(sum(len(c.completion_token_ids) for c in completions))
        self._queued[message.group_id] = group
        self.note_first(group)
        return Verdict(ACCEPTED)
