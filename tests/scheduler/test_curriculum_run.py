"""The curriculum in whole runs against in-memory peers: levels drawn by their success rate, the rates
in every step row and in GetStatus, and a restarted scheduler that rebuilds the rates from its ledger
and continues each level's stream where it stopped."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from grpo.common.v1 import types_pb2
from services.scheduler.ledger.audit import audit
from services.scheduler.ledger.store import read_ledger
from services.scheduler.peers.clients import EnvInfo, Scores, Split

from .fakes import FakeEnv, FakeRollout, cluster

LEVELS = ("easy", "mid", "hard")
REWARDS = {"easy": 1.0, "mid": None, "hard": 0.0}  # mid: completion 0 solves it, the others do not


class LeveledEnv(FakeEnv):
    """Three levels; the train stream without a level interleaves them (as services/env/cursor.py).
    Every completion of "easy" is right, none of "hard", one per group of "mid"."""

    def __init__(self) -> None:
        super().__init__()
        self.info = EnvInfo("leveled", levels=LEVELS, success_threshold=1.0)
        self.draws: list[tuple[str | None, int, int]] = []  # (level, start, n) of each train draw

    async def sample(
        self, n: int, split: Split, start: int | None = None, level: str | None = None
    ) -> list[types_pb2.Prompt]:
        if split == "eval":
            return await super().sample(n, split, start)
        first = start or 0
        self.draws.append((level, first, n))
        if level is not None:
            spots = [(level, j) for j in range(first, first + n)]
        else:
            spots = [(LEVELS[p % 3], p // 3) for p in range(first, first + n)]
        return [types_pb2.Prompt(id=f"{lv}-{j}", text=f"{j}+1=", metadata={"level": lv}) for lv, j in spots]

    async def score(self, prompt: types_pb2.Prompt, transcripts: Sequence[types_pb2.Transcript]) -> Scores:
        fixed = REWARDS[prompt.metadata["level"]]
        rewards = [fixed if fixed is not None else float(i == 0) for i in range(len(transcripts))]
        return Scores(rewards, [types_pb2.RewardInfo(ok=True) for _ in transcripts], skip_group=False)


def _steps(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward_mean" in r]


def _drawn(rows: list[dict], level: str) -> float:
    return sum(r[f"curriculum/level_{level}/drawn"] for r in rows)


CURRICULUM = {"enabled": True, "band_low": 0.2, "band_high": 0.8, "window": 4, "seed": 1}


async def test_a_curriculum_run_draws_the_levels_in_the_band_and_logs_their_rates(tmp_path: Path) -> None:
    env = LeveledEnv()
    c = cluster(tmp_path, FakeRollout("r0"), env=env, max_steps=12, curriculum=CURRICULUM)
    await c.run()
    assert c.orchestrator.finished and not c.orchestrator.error
    assert all(level is not None for level, _, _ in env.draws)  # every draw names its level
    rows = _steps(tmp_path)
    last = rows[-1]
    assert last["curriculum/level_easy/success"] == 1.0 and last["curriculum/level_hard/success"] == 0.0
    assert last["curriculum/level_mid/success"] == 0.5
    assert sum(_drawn(rows, lv) > 0 for lv in LEVELS) >= 2  # unseen levels were explored
    late = rows[-4:]  # long after every level was seen: only the level in the band is drawn
    assert _drawn(late, "mid") > 0 and _drawn(late, "easy") == _drawn(late, "hard") == 0
    assert c.orchestrator.status().level_success == {"easy": 1.0, "mid": 0.5, "hard": 0.0}
    trained = [g.prompt.id for b in c.learner.batches for g in b.groups]
    assert len(set(trained)) == len(trained)  # each level's stream moves on: no prompt twice


async def test_without_the_curriculum_the_levels_come_round_robin_and_are_still_logged(
    tmp_path: Path,
) -> None:
    env = LeveledEnv()
    c = cluster(tmp_path, FakeRollout("r0"), env=env, max_steps=6)
    await c.run()
    assert c.orchestrator.finished and all(level is None for level, _, _ in env.draws)
    rows = _steps(tmp_path)
    drawn = [_drawn(rows, lv) for lv in LEVELS]
    assert max(drawn) - min(drawn) <= 1 and sum(drawn) > 0  # uniform over the levels
    assert rows[-1]["curriculum/level_mid/success"] == 0.5


async def test_the_curriculum_needs_an_env_with_levels(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeRollout("r0"), curriculum={"enabled": True})
    with pytest.raises(ValueError, match="declares difficulty levels"):
        await c.run()


async def test_a_restarted_scheduler_rebuilds_the_rates_and_continues_each_level(tmp_path: Path) -> None:
    env = LeveledEnv()
    first = cluster(tmp_path, FakeRollout("r0"), env=env, max_steps=10, curriculum=CURRICULUM)
    run = asyncio.create_task(first.orchestrator.run())
    await first.learner.wait_for_version(4)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    ledger = read_ledger(tmp_path)
    outcomes, before, draws_before = ledger.level_outcomes, len(ledger.groups), len(env.draws)
    assert outcomes  # each scored group's level and solved count is in the ledger
    expected: dict[str, list[tuple[int, int]]] = {}
    for level, solved, total in outcomes:
        expected.setdefault(level, []).append((solved, total))
    expected_rates = {
        lv: sum(s for s, _ in rs[-4:]) / sum(t for _, t in rs[-4:]) for lv, rs in expected.items()
    }

    second = cluster(
        tmp_path, FakeRollout("r0"), env=env, learner=first.learner, max_steps=10, curriculum=CURRICULUM
    )
    seen_at_start: list[dict[str, float]] = []
    feed = second.orchestrator.groups.feed

    async def feed_and_look() -> None:  # the feeder starts once the run is prepared, before any draw
        seen_at_start.append(second.orchestrator.groups.levels.rates())
        await feed()

    second.orchestrator.groups.feed = feed_and_look
    await second.run()
    assert second.orchestrator.finished and not second.orchestrator.error
    assert seen_at_start == [expected_rates]  # rebuilt from the ledger, not started from nothing
    report = audit(read_ledger(tmp_path))
    assert report.ok, report.violations
    trained = [g.prompt.id for b in first.learner.batches for g in b.groups]
    assert len(set(trained)) == len(trained)  # no level position was drawn twice across the restart
    issued: dict[str, int] = {}  # each level's positions the first incarnation issued (ledger)
    for record in read_ledger(tmp_path).groups[:before]:
        level = LEVELS[record.position % 3]
        issued[level] = max(issued.get(level, 0), record.position // 3 + 1)
    resumed = {}
    for level, start, _ in env.draws[draws_before:]:
        resumed.setdefault(level, start)  # where the second incarnation took each level up again
    assert resumed and all(start == issued.get(level, 0) for level, start in resumed.items())
