"""Which CPU cores a service runs on (`--cpus 0-3,6`), and applying that choice to this process.

On a machine where the learner and vLLM-CPU rollouts share the cores, both size their thread pools to
the whole machine: torch's intra-op pool in the learner, vLLM's OpenMP workers (bound to cores) in the
rollout. Each parallel op then waits for its slowest thread, which is the one sharing a core with the
other process, so both run several times slower than either alone. Giving each service a disjoint
set of cores removes that: the affinity is inherited by the service's threads and by the processes it
starts (vLLM's engine and workers bind only to allowed cores), and torch sizes its pool to the set.

A split leaves the rollout's cores idle whenever it has nothing to generate (a learner-bound run waits
for the learner most of each step). Those cores are lent: the rollout keeps a one-byte busy file at
"1" while it has work (requests in flight, a probe, a weight stage or commit: `BusyFile`), and the
learner's model thread looks at it before each forward and backward pass and before each decoder
layer's: while every lender is idle it widens itself and torch's pool to the rollout's cores, else it
narrows them back (`CoreBorrower`). A rollout that wakes up mid-layer shares its core for the rest of
that layer only; a missing or unreadable busy file counts as busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator

from services.common.logging import get_logger

log = get_logger(__name__)


def parse_cpu_list(spec: str) -> frozenset[int]:
    """'0-3,6' → {0, 1, 2, 3, 6}; '' → empty (all cores). ValueError with the offending part."""
    cores: set[int] = set()
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high) if sep else int(low)
        except ValueError:
            raise ValueError(f"{part!r} is not a core number or a range like 2-5") from None
        if first < 0 or last < first:
            raise ValueError(f"{part!r} is not a valid range (first ≤ last, both ≥ 0)")
        cores.update(range(first, last + 1))
    return frozenset(cores)


def _checked_cpu_list(spec: str) -> str:
    parse_cpu_list(spec)  # ValueError with the offending part
    return spec


#: A settings field holding a core list ('0-3,6'; '' = none), checked when the settings load.
CpuList = Annotated[str, AfterValidator(_checked_cpu_list)]


def format_cpu_list(cores: frozenset[int] | set[int] | list[int]) -> str:
    """{0, 1, 2, 6} → '0-2,6' (the inverse of parse_cpu_list)."""
    ordered = sorted(cores)
    parts: list[str] = []
    start = prev = None
    for core in [*ordered, None]:
        if start is not None and (core is None or core != prev + 1):
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if core is not None and start is None:
            start = core
        prev = core
    return ",".join(parts)


def split_cores(cores: list[int], fraction: float) -> tuple[list[int], list[int]]:
    """Two disjoint non-empty halves of `cores` (the first gets round(fraction·n), at least one each).
    With a single core there is nothing to split: both get it."""
    if len(cores) < 2:
        return list(cores), list(cores)
    first = min(len(cores) - 1, max(1, round(fraction * len(cores))))
    return cores[:first], cores[first:]


def apply_cpu_affinity(spec: str) -> None:
    """Restrict this process (and what it starts later) to the cores in `spec`; '' leaves it alone.

    Also sets OMP_NUM_THREADS for child processes and torch's intra-op pool if torch is loaded, since
    both were sized from the whole machine before this ran.
    """
    cores = parse_cpu_list(spec)
    if not cores:
        return
    available = os.sched_getaffinity(0)
    if not cores <= available:
        raise ValueError(f"--cpus {spec}: cores {format_cpu_list(cores - available)} are not available here")
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(len(cores))
    log.info("cpu affinity set", cpus=format_cpu_list(cores), threads=len(cores))


def move_process_threads(spec: str) -> None:
    """Move every thread of this process to the cores in `spec` ('' leaves them alone); threads it
    starts later inherit that. Processes it has already started keep their cores: a rollout moves its
    own front end (gRPC, tokenization, vLLM's output processing) off the cores of its engine process.
    """
    cores = parse_cpu_list(spec)
    if not cores:
        return
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            raise ValueError(f"cannot move this process to cores {spec}: {exc}") from exc
    log.info("process threads moved", cpus=format_cpu_list(cores))


# How long a lender stays busy after its last work ends. A rollout's work comes in bursts separated by
# a scheduler round trip (stage, commit, then the requests the commit admits): a learner pass starting
# in such a gap would borrow the cores just as the next burst lands on them. Measured on the tiny
# model: the learner's backward checked inside the ~1 ms commit → generate gap in ~30 % of its passes.
LINGER_S = 0.02


class BusyFile:
    """The lender's side: a one-byte file that reads "1" while this process has work in flight (and for
    `linger_s` after it, when the work ran on an event loop)."""

    def __init__(self, path: Path, linger_s: float = LINGER_S) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._busy: bool | None = None
        self._working = 0
        self._linger_s = linger_s
        self._idle_later: asyncio.TimerHandle | None = None
        self.set(False)

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        """Busy while any `working()` block runs (they nest and overlap), and `linger_s` after."""
        if self._idle_later is not None:
            self._idle_later.cancel()
            self._idle_later = None
        self._working += 1
        self.set(True)
        try:
            yield
        finally:
            self._working -= 1
            if not self._working:
                self._idle_soon()

    def _idle_soon(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (a generator finalised late): no one to wait for
            loop = None
        if loop is None or self._linger_s <= 0:
            self.set(False)
        else:
            self._idle_later = loop.call_later(self._linger_s, self._idle)

    def _idle(self) -> None:
        self._idle_later = None
        if not self._working:
            self.set(False)

    def set(self, busy: bool) -> None:
        """Write the state if it changed (one pwrite of a page-cached byte: microseconds)."""
        if busy != self._busy and self._fd >= 0:
            os.pwrite(self._fd, b"1" if busy else b"0", 0)
            self._busy = busy

    def close(self) -> None:
        if self._idle_later is not None:
            self._idle_later.cancel()
            self._idle_later = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def lender_idle(path: Path) -> bool:
    """Whether the lender behind `path` says it is idle; anything but a readable "0" counts as busy."""
    try:
        with open(path, "rb") as f:
            return f.read(1) == b"0"
    except OSError:
        return False


class CoreBorrower:
    """The learner's side: borrow `lent` cores for the calling thread while every lender is idle.

    `borrow()` and `give_back()` change the calling thread's affinity and torch's intra-op pool (both
    per thread), so call them on the thread that runs the model. Threads torch's pool started while
    borrowing keep the wider affinity but sleep while the pool is back to `own`'s size.
    """

    def __init__(self, own: frozenset[int], lent: frozenset[int], busy_files: Sequence[Path]) -> None:
        if not own or not lent or not busy_files:
            raise ValueError("borrowing needs the learner's own cores, the lent cores and a busy file")
        self.own = own
        self.wide = own | lent
        self.busy_files = tuple(busy_files)
        self._current: frozenset[int] | None = None

    def borrow(self) -> bool:
        """Use own ∪ lent cores if every lender is idle now, else own; returns whether it borrowed."""
        idle = all(lender_idle(path) for path in self.busy_files)
        self._use(self.wide if idle else self.own)
        return idle

    def give_back(self) -> None:
        self._use(self.own)

    def _use(self, cores: frozenset[int]) -> None:
        if cores == self._current:
            return
        import torch

        os.sched_setaffinity(0, cores)  # 0 = the calling thread
        torch.set_num_threads(len(cores))
        self._current = cores
