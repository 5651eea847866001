"""Prompt cursors: where each split of one environment is, and which prompt each position holds.

The environment is stateless (base.py); the service owns one `PromptCursor` per loaded environment.
A position counts prompts served from a split since the start of the run:

* **train**: a finite split (split_size > 0) is read in epochs, and each epoch's order is a seeded
  shuffle, `random.Random(f"{env.name}/{env.seed}/epoch/{epoch}")`, so the same env and seed give the
  same stream and a saved position resumes it exactly. A procedural split (size 0) maps position i
  to item i. Train never runs out: it cycles epochs.
* **eval**: fixed order, position i is item i, and it never wraps around: asking for more prompts
  than are left serves each remaining prompt once (min(n, size - start) of them).

A source that overrides `Environment.sample` (no random access) gets the positions as they are and
chooses its own order; the eval bound still applies when it declares an eval `split_size`.

**Levels** (`Environment.levels()`, K of them): each level is a train stream of its own, with its own
position (`level_positions`), read like the train split (`level_size`, `level_prompt_at`, a finite
level shuffled per epoch by `f"{env.name}/{env.seed}/level/{level}/epoch/{epoch}"`). The train split
drawn without a level interleaves them: its position p is position p // K of level levels[p % K]. So
level L's position j is train position j * K + L's index (`interleaved`): a scheduler that draws by
level keeps one position space, the train split's, and the same position always holds the same
prompt. Every train prompt of a leveled env carries `metadata["level"]`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument, quoted
from services.env.base import SPLITS, Environment, PromptItem, SplitName, has_own_sample

# The largest position a draw may start at. Positions are int64 on the wire (next_position) and JSON
# numbers in the scheduler's ledger: 2^53 keeps both exact and is beyond any run (10^6 prompts/s for
# 285 years). A draw past it is refused before the cursor moves, so one bad call cannot break the feed.
MAX_POSITION = 2**53


@dataclass(frozen=True)
class Draw:
    """Prompts drawn from one split: `prompts[i]` sits at position `start + i`."""

    start: int
    prompts: list[PromptItem]
    requested: int

    @property
    def next_position(self) -> int:
        return self.start + len(self.prompts)


def interleaved(levels: Sequence[str], level: str, position: int) -> int:
    """The train-split position of `level`'s stream position `position` (see the module docstring)."""
    return position * len(levels) + list(levels).index(level)


class PromptCursor:
    """Positions of the train and eval splits of `env` (and of each of its levels), and the position →
    item mapping. Positions are reserved before any prompt is read, so concurrent draws get disjoint
    ranges.
    """

    def __init__(self, env: Environment[Any]) -> None:
        self.env = env
        self.levels: tuple[str, ...] = tuple(env.levels())
        if len(set(self.levels)) != len(self.levels) or not all(self.levels):
            raise ValueError(
                f"environment {env.name!r}: levels must be distinct non-empty names: {self.levels}"
            )
        if self.levels and has_own_sample(env):
            raise ValueError(
                f"environment {env.name!r}: levels need random access (level_prompt_at), not sample"
            )
        self._positions: dict[SplitName, int] = dict.fromkeys(SPLITS, 0)
        self._level_positions: dict[str, int] = {}
        self._epoch_order: dict[str, tuple[tuple[int, int], list[int]]] = {}  # key -> ((size, epoch), order)

    def positions(self) -> dict[SplitName, int]:
        """Every split's position (what a run saves to resume; GetEnvironmentState reports it)."""
        return dict(self._positions)

    def level_positions(self) -> dict[str, int]:
        """The position of each level stream drawn from by name so far."""
        return dict(self._level_positions)

    def index_at(self, split: SplitName, position: int, size: int | None = None) -> int:
        """The item index (for `prompt_at`) at a position: train shuffled per epoch, eval as is
        (`size`: the split's size when the caller has it already; `split_size` is user code)."""
        size = self.env.split_size(split) if size is None else size
        if size == 0 or split == "eval":
            return position % size if size else position
        return self._shuffled(f"{self.env.name}/{self.env.seed}/epoch", size, position)

    def level_index_at(self, level: str, position: int, size: int) -> int:
        """The item index (for `level_prompt_at`) at a position of a level's stream."""
        if size == 0:
            return position
        return self._shuffled(f"{self.env.name}/{self.env.seed}/level/{level}/epoch", size, position)

    def _shuffled(self, key: str, size: int, position: int) -> int:
        epoch, offset = divmod(position, size)
        cached = self._epoch_order.get(key)  # draws in other threads may replace the cache meanwhile
        if cached is None or cached[0] != (size, epoch):
            order = list(range(size))
            random.Random(f"{key}/{epoch}").shuffle(order)
            cached = ((size, epoch), order)
            self._epoch_order[key] = cached
        return cached[1][offset]

    def _count(self, split: SplitName, start: int, n: int) -> int:
        """How many of `n` prompts from `start` the split can serve (eval stops at its end)."""
        if split == "train":
            return n
        size = self.env.split_size(split)
        if size == 0:
            raise FailedPrecondition(f"environment {self.env.name!r} has no eval split (eval_size = 0)")
        if start >= size:
            raise InvalidArgument(
                f"eval position {start} is past the end of the eval split ({size} prompts); "
                "replay it with start=0"
            )
        return min(n, size - start)

    def check_level(self, split: SplitName, level: str) -> None:
        """A level named in a draw must be one of the env's, and the split must be train."""
        if not self.levels:
            raise InvalidArgument(
                f"environment {self.env.name!r} declares no levels; got level {quoted(level)}"
            )
        if level not in self.levels:
            raise InvalidArgument(
                f"unknown level {quoted(level)}; environment {self.env.name!r} has {list(self.levels)}"
            )
        if split != "train":
            raise InvalidArgument(
                f"a level names a train stream; got level {quoted(level)} with split {split!r}"
            )

    async def take(
        self, n: int, split: SplitName, start: int | None = None, level: str | None = None
    ) -> Draw:
        """Up to `n` prompts of `split` (or of `level`'s own train stream) from `start` (default: where
        it is); advances that cursor.

        Train always serves `n`; eval serves min(n, size - start). Reading runs off the event loop
        (a thread for `prompt_at`; an overridden `sample` is awaited and must not block).
        """
        if level is not None:
            self.check_level(split, level)
        positions = self._level_positions if level is not None else self._positions
        key = level if level is not None else split
        first = positions.get(key, 0) if start is None else start  # type: ignore[call-overload]
        if not 0 <= first <= MAX_POSITION - n:
            raise InvalidArgument(f"start must be in [0, {MAX_POSITION - n}] for n={n}, got {first}")
        count = self._count(split, first, n)
        positions[key] = first + count  # type: ignore[index]
        if level is not None:
            prompts = await asyncio.to_thread(self._read_level, level, first, count)
        elif split == "train" and self.levels:
            prompts = await asyncio.to_thread(self._read_interleaved, first, count)
        elif has_own_sample(self.env):
            prompts = await self.env.sample(count, split, first)
            if len(prompts) != count:
                raise FailedPrecondition(
                    f"environment {self.env.name!r} returned {len(prompts)} prompts for n={count}"
                )
        else:
            prompts = await asyncio.to_thread(self._read, split, first, count)
        return Draw(start=first, prompts=list(prompts), requested=n)

    def _read(self, split: SplitName, start: int, count: int) -> list[PromptItem]:
        size = self.env.split_size(split)
        return [self.env.prompt_at(split, self.index_at(split, start + i, size)) for i in range(count)]

    def _level_item(self, level: str, position: int) -> PromptItem:
        item = self.env.level_prompt_at(
            level, self.level_index_at(level, position, self.env.level_size(level))
        )
        return replace(item, metadata={**item.metadata, "level": level})

    def _read_level(self, level: str, start: int, count: int) -> list[PromptItem]:
        return [self._level_item(level, start + i) for i in range(count)]

    def _read_interleaved(self, start: int, count: int) -> list[PromptItem]:
        k = len(self.levels)
        return [self._level_item(self.levels[p % k], p // k) for p in range(start, start + count)]
