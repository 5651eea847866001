"""The curriculum: per-level success rates of an environment with difficulty levels, and which level
the next prompts are drawn from. Pure logic: no I/O, no asyncio.

An environment may declare levels (services/env/base.py: `levels()`, easiest first). Whenever it
does, `LevelStats` keeps each level's recent success rate: the fraction of completions with reward >=
the env's success threshold over the last `window` scored groups of that level (groups filtered by
dynamic sampling count: they were scored). The rates are rebuilt from the ledger's `level_outcomes`
rows on start (`rebuild`), so a restarted scheduler goes on with what it knew, and every step row
carries them (`record`: `curriculum/level_<name>/success`, and `curriculum/level_<name>/drawn`, the
prompts drawn from the level since the last row).

With the curriculum on (`CurriculumSettings.enabled`), `draw` picks each prompt's level (prime-rl's
difficulty-pool sampler is the model): uniformly, from the run's seeded stream, among the levels in
the target band, band_low <= rate <= band_high, counting a level with no scored group yet as in the
band (it is explored). When no level is in the band, the level whose rate is nearest the band is
drawn (all too hard: the easiest-looking one; all too easy: the hardest-looking one), ties going to the
easier level. With it off, the env's train stream interleaves the levels round-robin (uniform).

Positions: level L's j-th prompt sits at train position j * K + index(L) (services/env/cursor.py), so
drawing by level keeps the ledger's one position space; `level_cursors` recovers each level's next
position from the positions the ledger's groups took.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from services.scheduler.config import CurriculumSettings

# The prompt metadata key an environment's train prompts carry their level under (cursor.py sets it).
LEVEL_KEY = "level"


def group_outcome(rewards: Sequence[float], threshold: float) -> tuple[int, int]:
    """(completions solved, completions) of one scored group."""
    return sum(1 for r in rewards if r >= threshold), len(rewards)


def level_position(levels: Sequence[str], level: str, position: int) -> int:
    """The train position of `level`'s stream position `position` (services/env/cursor.py)."""
    return position * len(levels) + list(levels).index(level)


def level_cursors(levels: Sequence[str], positions: Iterable[int]) -> dict[str, int]:
    """Each level's next stream position, from the train positions groups took (interleaved)."""
    k = len(levels)
    cursors = dict.fromkeys(levels, 0)
    for position in positions:
        level = levels[position % k]
        cursors[level] = max(cursors[level], position // k + 1)
    return cursors


class LevelStats:
    """Recent success per level, the draws, and the metrics of both (see the module docstring)."""

    def __init__(self, levels: Sequence[str], settings: CurriculumSettings, threshold: float) -> None:
        self.levels = list(levels)
        self.settings = settings
        self.threshold = threshold
        self._recent: dict[str, deque[tuple[int, int]]] = {
            level: deque(maxlen=settings.window) for level in self.levels
        }
        self._rng = random.Random(f"curriculum/{settings.seed}")
        self._drawn: Counter[str] = Counter()  # since the last `record`

    @property
    def drawing(self) -> bool:
        """The curriculum picks the levels (else the env's round-robin stream does)."""
        return self.settings.enabled and bool(self.levels)

    def observe(self, level: str, solved: int, total: int) -> None:
        """One scored group of `level`: `solved` of its `total` completions reached the threshold."""
        if level in self._recent and total > 0:
            self._recent[level].append((solved, total))

    def observe_rewards(self, level: str, rewards: Sequence[float]) -> tuple[int, int]:
        """`observe` a group by its rewards; returns its (solved, total) for the ledger."""
        outcome = group_outcome(rewards, self.threshold)
        self.observe(level, *outcome)
        return outcome

    def rebuild(self, outcomes: Iterable[tuple[str, int, int]]) -> None:
        """Replay the ledger's (level, solved, total) rows, oldest first (a restart)."""
        for level, solved, total in outcomes:
            self.observe(level, solved, total)

    def rate(self, level: str) -> float | None:
        """The level's success rate over its window; None before its first scored group."""
        recent = self._recent.get(level)
        if not recent:
            return None
        return sum(s for s, _ in recent) / sum(t for _, t in recent)

    def rates(self) -> dict[str, float]:
        """Every level with a scored group: its success rate."""
        return {level: rate for level in self.levels if (rate := self.rate(level)) is not None}

    def eligible(self) -> list[str]:
        """The levels `draw` chooses among (see the module docstring for the rule)."""
        low, high = self.settings.band_low, self.settings.band_high
        rates = {level: self.rate(level) for level in self.levels}
        in_band = [lv for lv, r in rates.items() if r is None or low <= r <= high]
        if in_band:
            return in_band
        distance = {lv: (low - r if r < low else r - high) for lv, r in rates.items() if r is not None}
        nearest = min(distance.values())
        return [next(lv for lv in self.levels if distance[lv] == nearest)]  # ties: the easier level

    def draw(self, n: int) -> list[str]:
        """The levels of the next `n` prompts (counted as drawn)."""
        choices = self.eligible()
        drawn = [self._rng.choice(choices) for _ in range(n)]
        self._drawn.update(drawn)
        return drawn

    def served(self, levels: Iterable[str]) -> None:
        """Count prompts drawn by the env's own (round-robin) stream."""
        self._drawn.update(level for level in levels if level in self._recent)

    def record(self) -> dict[str, float]:
        """The step row's figures; the drawn counts start again from 0."""
        row: dict[str, float] = {}
        for level in self.levels:
            rate = self.rate(level)
            if rate is not None:
                row[f"curriculum/level_{level}/success"] = rate
            row[f"curriculum/level_{level}/drawn"] = float(self._drawn[level])
        self._drawn.clear()
        return row
