"""PromptCursor: the train order is the one environments had before the cursor moved out of them,
eval is fixed and never wraps, `start` restores a position, and reads run off the event loop."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from services.common.errors import FailedPrecondition, InvalidArgument
from services.env.base import Environment, PromptItem, SplitName
from services.env.cursor import PromptCursor
from services.env.loader import load_environment


class Toy(Environment):
    """Five train prompts, three eval prompts; records which thread reads them."""

    name: ClassVar[str] = "toy"

    def __init__(self) -> None:
        super().__init__()
        self.reader_threads: set[str] = set()

    def split_size(self, split: SplitName) -> int:
        return 5 if split == "train" else 3

    def prompt_at(self, split: SplitName, index: int) -> PromptItem:
        self.reader_threads.add(threading.current_thread().name)
        return PromptItem(id=f"toy-{split}-{index}", text=str(index))


def indices(prompts: list[PromptItem]) -> list[int]:
    return [int(p.id.rsplit("-", 1)[1]) for p in prompts]


# The rows of test_builtins.py: 31 GSM8K-style rows, 5 held out for eval, 26 train.
ROWS = [
    {
        "question": f"Tom has {i} apples and buys {i + 3} more. How many apples?",
        "answer": f"{i}+{i + 3}=#### {2 * i + 3}",
    }
    for i in range(30)
] + [{"question": "A shop sells 1,000 pens a day for 2 days.", "answer": "1000*2=2000\n#### 2,000"}]

# Orders recorded from the pre-cursor implementation (Environment.sample with its own cursor), so a
# change to the shuffle key, the epoch arithmetic or the RNG shows up here.
TOY_TRAIN_3_EPOCHS = [3, 4, 2, 0, 1, 3, 2, 4, 0, 1, 0, 1, 2, 4, 3]
GSM8K_TRAIN_30 = [
    23,
    5,
    25,
    24,
    8,
    19,
    7,
    10,
    4,
    18,
    6,
    3,
    16,
    17,
    13,
    12,
    15,
    14,
    22,
    11,
    9,
    2,
    1,
    21,
    0,
    20,
]
GSM8K_TRAIN_30 += [23, 9, 1, 12]


async def test_train_order_is_the_recorded_one_across_epochs() -> None:
    toy = PromptCursor(Toy())
    got = []
    for n in (2, 4, 9):  # draws that straddle epoch boundaries
        got += indices((await toy.take(n, "train")).prompts)
    assert got == TOY_TRAIN_3_EPOCHS
    for epoch in range(3):  # each epoch is the seeded shuffle named in the docs
        order = list(range(5))
        random.Random(f"toy/0/epoch/{epoch}").shuffle(order)
        assert got[5 * epoch : 5 * epoch + 5] == order


async def test_gsm8k_like_finite_data_keeps_its_order(tmp_path: Path) -> None:
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    env = load_environment("gsm8k", {"path": str(path), "eval_size": 5})
    await env.setup()
    draw = await PromptCursor(env).take(30, "train")
    assert indices(draw.prompts) == GSM8K_TRAIN_30  # 26 train rows: the last 4 are epoch 1
    assert (draw.start, draw.next_position) == (0, 30)


async def test_procedural_split_is_identity() -> None:
    cursor = PromptCursor(load_environment("arithmetic"))
    draw = await cursor.take(3, "train", start=100)
    assert [p.id for p in draw.prompts] == [f"arithmetic-train-{i}" for i in (100, 101, 102)]
    assert [p.text for p in draw.prompts] == ["85-87=", "93+50=", "47-56="]  # recorded before the move
    assert cursor.positions() == {"train": 103, "eval": 0}


async def test_eval_is_fixed_and_never_wraps() -> None:
    cursor = PromptCursor(Toy())
    first = await cursor.take(5, "eval", start=0)
    assert indices(first.prompts) == [0, 1, 2] and first.requested == 5 and first.next_position == 3
    tail = await cursor.take(10, "eval", start=2)
    assert indices(tail.prompts) == [2]
    with pytest.raises(InvalidArgument, match="past the end of the eval split"):
        await cursor.take(1, "eval")  # the cursor sits at 3 = the end; no wrap-around
    assert indices((await cursor.take(2, "eval", start=0)).prompts) == [0, 1]
    with pytest.raises(FailedPrecondition, match="no eval split"):
        await PromptCursor(load_environment("arithmetic", {"eval_size": 0})).take(1, "eval")


async def test_start_restores_a_position() -> None:
    run = PromptCursor(Toy())
    seen = (await run.take(8, "train")).prompts
    resumed = PromptCursor(Toy())  # a fresh service resuming from a saved position
    draw = await resumed.take(4, "train", start=3)
    assert [p.id for p in draw.prompts] == [p.id for p in seen[3:7]]
    assert resumed.positions() == {"train": 7, "eval": 0}
    assert indices((await resumed.take(1, "train")).prompts) == [TOY_TRAIN_3_EPOCHS[7]]


async def test_concurrent_draws_get_disjoint_positions_and_read_off_the_loop() -> None:
    env = Toy()
    cursor = PromptCursor(env)
    draws = await asyncio.gather(*(cursor.take(3, "train") for _ in range(4)))
    assert sorted(d.start for d in draws) == [0, 3, 6, 9]
    by_start = {d.start: d for d in draws}
    assert [i for s in sorted(by_start) for i in indices(by_start[s].prompts)] == TOY_TRAIN_3_EPOCHS[:12]
    assert threading.main_thread().name not in env.reader_threads


class Stream(Environment):
    """A source without random access: overrides `sample` and gets the positions from the cursor."""

    name: ClassVar[str] = "stream"

    def __init__(self, short: bool = False) -> None:
        super().__init__()
        self.calls: list[tuple[int, str, int]] = []
        self.short = short

    def split_size(self, split: SplitName) -> int:
        return 0 if split == "train" else 4

    async def sample(self, n: int, split: SplitName, start: int) -> list[PromptItem]:
        self.calls.append((n, split, start))
        items = [PromptItem(id=f"s-{split}-{start + i}", text="q") for i in range(n)]
        return items[:-1] if self.short else items


async def test_sources_without_random_access_get_explicit_positions() -> None:
    env = Stream()
    cursor = PromptCursor(env)
    await cursor.take(2, "train")
    await cursor.take(3, "train")
    await cursor.take(1, "train", start=10)
    eval_draw = await cursor.take(9, "eval", start=1)
    assert env.calls == [(2, "train", 0), (3, "train", 2), (1, "train", 10), (3, "eval", 1)]
    assert [p.id for p in eval_draw.prompts] == ["s-eval-1", "s-eval-2", "s-eval-3"]
    assert cursor.positions() == {"train": 11, "eval": 4}
    with pytest.raises(FailedPrecondition, match="returned 1 prompts for n=2"):
        await PromptCursor(Stream(short=True)).take(2, "train")
