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
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from services.common.errors import FailedPrecondition, InvalidArgument
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


class PromptCursor:
    """Positions of the train and eval splits of `env`, and the position → item mapping.

    Positions are reserved before any prompt is read, so concurrent draws get disjoint ranges.
    """

    def __init__(self, env: Environment[Any]) -> None:
        self.env = env
        self._positions: dict[SplitName, int] = dict.fromkeys(SPLITS, 0)
        self._epoch_order: tuple[tuple[int, int], list[int]] | None = None  # ((size, epoch), order)

    def positions(self) -> dict[SplitName, int]:
        """Every split's position (what a run saves to resume; GetEnvironmentState reports it)."""
        return dict(self._positions)

    def index_at(self, split: SplitName, position: int, size: int | None = None) -> int:
        """The item index (for `prompt_at`) at a position: train shuffled per epoch, eval as is
        (`size`: the split's size when the caller has it already; `split_size` is user code)."""
        size = self.env.split_size(split) if size is None else size
        if size == 0:
            return position
        epoch, offset = divmod(position, size)
        if split == "eval":
            return offset
        cached = self._epoch_order  # a local: draws in other threads may replace the cache meanwhile
        if cached is None or cached[0] != (size, epoch):
            order = list(range(size))
            random.Random(f"{self.env.name}/{self.env.seed}/epoch/{epoch}").shuffle(order)
            cached = ((size, epoch), order)
            self._epoch_order = cached
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

    async def take(self, n: int, split: SplitName, start: int | None = None) -> Draw:
        """Up to `n` prompts of `split` from `start` (default: where the split is); advances the cursor.

        Train always serves `n`; eval serves min(n, size - start). Reading runs off the event loop
        (a thread for `prompt_at`; an overridden `sample` is awaited and must not block).
        """
        first = self._positions[split] if start is None else start
        if not 0 <= first <= MAX_POSITION - n:
            raise InvalidArgument(f"start must be in [0, {MAX_POSITION - n}] for n={n}, got {first}")
        count = self._count(split, first, n)
        self._positions[split] = first + count
        if has_own_sample(self.env):
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
