"""The learner-side fence of `cuda_ipc`: a staging buffer is rewritten only when no rollout may still
read it. Pure (no torch, no CUDA): `cuda_ipc.py` asks it which buffer ("slot") to pack a version into.

A rollout reads a slot while it serves (zero-copy) or stages the version packed there. A rollout that
is alive but unreachable (a partition, not a crash) cannot be told to copy its weights out, so the
learner must not overwrite what it reads. The rule:

- the readers of a slot are the receivers its version was described to (every PrepareWeights that
  named them, `describe`); a reader found off it (below) is forgotten, since only a new description
  brings it back;
- a reader is OFF the slot only when the scheduler lists it in a PrepareWeights' holders and it
  serves a different version, or copied its weights into its own memory (`owns_weights`), or is
  another incarnation (restarted: the old process and its mappings are gone). The scheduler lists
  every rollout whose version it knows for certain: reachable with its state read, or unreachable
  with nothing sent to it since its last acknowledged commit (it cannot move on its own). One it
  does not list (lost mid-sync: it may serve its old version or be staging the new one) is taken to
  still read every slot it was described;
- a slot is free when its version is not prepared (released by the scheduler: no stage of it is
  under way) and no reader is left. A version goes into the free slot holding the oldest version;
  with none free, a new slot is made, up to `max_slots` (each a model-sized GPU buffer); beyond that
  PrepareWeights is refused with FAILED_PRECONDITION naming the rollouts that hold the buffers (they
  must come back and move on, or be removed, before the learner can publish again).

With every rollout reachable and synced each step this is the double buffer of `cuda_ipc.py`: version
v goes into the slot of v - 2, whose readers all serve v - 1 or v by then. A PrepareWeights that lists
no holders (`holders_listed` unset: a scheduler from before the fence) gets that double buffer
unfenced, version v in slot v % 2, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.errors import FailedPrecondition

DEFAULT_MAX_SLOTS = 3
HOLDERS_KEY = "weight_holders"  # PublishContext.state: the holders of the PrepareWeights being served


@dataclass(frozen=True)
class Holder:
    """What the scheduler vouches a rollout serves now (a PrepareWeights' `holders`)."""

    rollout_id: str
    instance_id: str
    version: int
    owns_weights: bool = False


@dataclass
class Slot:
    version: int | None = None  # the version packed in it (None: never used)
    readers: dict[str, str] = field(default_factory=dict)  # rollout id -> instance that may read it
    prepared: bool = False  # described and not yet released


class SlotFence:
    """Which staging buffer each version goes into, and who may still read each one."""

    def __init__(self, max_slots: int = DEFAULT_MAX_SLOTS) -> None:
        if max_slots < 2:
            raise ValueError("cuda_ipc needs at least two staging buffers")
        self.max_slots = max_slots
        self.slots: list[Slot] = []

    def choose(self, version: int, holders: Iterable[Holder] | None) -> int:
        """The slot to pack `version` into (marked prepared, its readers cleared): the free slot holding
        the oldest version, else a new one; FailedPrecondition when neither exists. `holders` None: a
        caller that lists none (an older scheduler) gets the plain double buffer, slot `version % 2`,
        unfenced."""
        if holders is None:
            while len(self.slots) < 2:
                self.slots.append(Slot())
            index = version % 2
            self.slots[index] = Slot(version, {}, prepared=True)
            return index
        listed = {h.rollout_id: h for h in holders}
        for slot in self.slots:  # off once, off until described again: forget it
            if not slot.prepared:
                slot.readers = {r: i for r, i in slot.readers.items() if not self.off(slot, r, i, listed)}
        free = [i for i, slot in enumerate(self.slots) if not slot.prepared and not slot.readers]
        if free:
            index = min(free, key=lambda i: -1 if self.slots[i].version is None else self.slots[i].version)
        elif len(self.slots) < self.max_slots:
            index = len(self.slots)
            self.slots.append(Slot())
        else:
            raise FailedPrecondition(self._why_fenced())
        self.slots[index] = Slot(version, {}, prepared=True)
        return index

    def describe(self, index: int, receivers: Iterable[tuple[str, str]]) -> None:
        """The slot's version was described to these (rollout id, instance id): they may read it."""
        self.slots[index].readers.update(dict(receivers))

    def abandon(self, index: int) -> None:
        """Packing the slot's version failed before it was described to anyone: nobody reads it."""
        self.slots[index] = Slot()

    def released(self, index: int) -> None:
        """The scheduler released the slot's version: no new reader will stage it."""
        self.slots[index].prepared = False

    @staticmethod
    def off(slot: Slot, rollout_id: str, instance_id: str, listed: dict[str, Holder]) -> bool:
        holder = listed.get(rollout_id)
        return holder is not None and (
            holder.instance_id != instance_id or holder.owns_weights or holder.version != slot.version
        )

    def _why_fenced(self) -> str:
        held = []
        for index, slot in enumerate(self.slots):
            if slot.prepared:
                held.append(f"slot {index} (version {slot.version}) is still prepared")
                continue
            readers = sorted(slot.readers)
            held.append(f"slot {index} (version {slot.version}) may still be read by {', '.join(readers)}")
        return (
            f"every cuda_ipc staging buffer may still be read ({'; '.join(held)}) and {self.max_slots} is "
            "the most: a rollout the scheduler cannot vouch for (unreachable) must come back and move "
            "to a newer version, or copy its weights out, before the learner overwrites its buffer"
        )
