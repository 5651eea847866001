"""The curriculum's pure logic: success rates over a window, the band rule, determinism, the rebuild
from ledger rows, and each level's position in the one train-position space."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.scheduler.config import CurriculumSettings
from services.scheduler.pipeline.curriculum import LevelStats, group_outcome, level_cursors, level_position

LEVELS = ["1", "2", "3", "4"]


def stats(**settings) -> LevelStats:
    return LevelStats(LEVELS, CurriculumSettings(enabled=True, **settings), threshold=1.0)


def test_a_levels_rate_is_the_solved_fraction_over_its_last_window_groups() -> None:
    s = stats(window=2)
    assert s.rate("1") is None and s.rates() == {}
    assert s.observe_rewards("1", [1.0, 0.0, 0.0, 0.0]) == (1, 4)  # reward >= threshold counts
    assert s.rate("1") == 0.25
    s.observe("1", 4, 4)
    assert s.rate("1") == 5 / 8
    s.observe("1", 0, 4)  # the first group leaves the window
    assert s.rate("1") == 0.5
    s.observe("nope", 3, 4)  # an unknown level (another env's prompt) is ignored
    assert s.rates() == {"1": 0.5}


def test_group_outcome_uses_the_threshold() -> None:
    assert group_outcome([0.5, 0.49, 1.0], 0.5) == (2, 3)


def test_unseen_levels_count_as_in_the_band_and_out_of_band_levels_are_not_drawn() -> None:
    s = stats(band_low=0.2, band_high=0.8)
    assert s.eligible() == LEVELS  # nothing seen: every level is explored
    s.observe("1", 8, 8)  # too easy
    s.observe("2", 4, 8)  # in the band
    s.observe("4", 0, 8)  # too hard
    assert s.eligible() == ["2", "3"]  # "3" is unseen
    assert set(s.draw(50)) == {"2", "3"}


def test_with_no_level_in_the_band_the_nearest_is_drawn_ties_to_the_easier() -> None:
    s = stats(band_low=0.2, band_high=0.8)
    for level, solved in zip(LEVELS, (8, 8, 1, 0), strict=True):  # 1.0, 1.0, 0.125, 0.0
        s.observe(level, solved, 8)
    assert s.eligible() == ["3"]  # 0.075 below the band beats 0.2 above it
    t = stats(band_low=0.2, band_high=0.8)
    for level in LEVELS:
        t.observe(level, 0, 8)  # all too hard: all 0.2 away, the easiest wins
    assert t.eligible() == ["1"]
    u = stats(band_low=0.2, band_high=0.8)
    for level in LEVELS:
        u.observe(level, 8, 8)
    assert u.eligible() == ["1"]  # all too easy, equally: the tie goes to the easier level


def test_draws_are_deterministic_under_the_seed_and_counted_for_the_row() -> None:
    assert stats(seed=3).draw(40) == stats(seed=3).draw(40)
    assert stats(seed=3).draw(40) != stats(seed=4).draw(40)
    s = stats()
    drawn = s.draw(12)
    s.served(["1", "1", "x"])  # the env's own stream's prompts count too (not unknown levels)
    s.observe("2", 1, 2)
    row = s.record()
    assert row["curriculum/level_1/drawn"] == drawn.count("1") + 2
    assert sum(row[f"curriculum/level_{lv}/drawn"] for lv in LEVELS) == 14
    assert row["curriculum/level_2/success"] == 0.5 and "curriculum/level_1/success" not in row
    assert all(v == 0 for k, v in s.record().items() if k.endswith("/drawn"))  # counts start again


def test_rebuild_from_ledger_rows_gives_the_same_rates_and_draws() -> None:
    rows = [("1", 4, 4), ("2", 2, 4), ("1", 3, 4), ("4", 0, 4), ("2", 1, 4)]
    live = stats(window=2)
    for row in rows:
        live.observe(*row)
    rebuilt = stats(window=2)
    rebuilt.rebuild(rows)
    assert rebuilt.rates() == live.rates() == {"1": 7 / 8, "2": 3 / 8, "4": 0.0}
    assert rebuilt.eligible() == live.eligible() == ["2", "3"]
    assert rebuilt.draw(20) == live.draw(20)  # same rates, same seeded stream: the same draws


def test_level_positions_share_the_train_position_space() -> None:
    positions = [level_position(LEVELS, lv, j) for lv in LEVELS for j in range(5)]
    assert len(set(positions)) == 20 and set(positions) == set(range(20))  # round-robin interleave
    assert level_position(LEVELS, "3", 2) == 10
    assert level_cursors(LEVELS, [10, 2, 0, 7]) == {"1": 1, "2": 0, "3": 3, "4": 2}
    assert level_cursors(LEVELS, []) == dict.fromkeys(LEVELS, 0)


def test_the_band_must_be_ordered() -> None:
    with pytest.raises(ValidationError, match="band_low"):
        CurriculumSettings(band_low=0.9, band_high=0.1)
    assert not CurriculumSettings().enabled  # off by default
