"""The run directory's record of the services a launcher started, and how recorded services are stopped.

    <run-dir>/live.json   the launcher (pid, start time) and each service it started: its role, pid,
                          start time and port; rewritten atomically at every start and restart,
                          removed when the launcher has stopped them

A process is named by its pid *and* its start time (field 22 of `/proc/<pid>/stat`, clock ticks since
boot): a pid is reused once its process is gone, so a pid whose start time differs from the recorded
one is somebody else's and is never signalled. Nothing is ever found or signalled by name.

`stop()` ends recorded services the way the launcher does: SIGTERM to each verified pid (followed by
SIGCONT, so a stopped one wakes up to act on it), and once they exited or the grace is over, SIGKILL
to the process group each one leads (services run in sessions of their own: the group is the service
and what it started, vLLM's engine processes). The group is ours while its leader is the recorded
process, or while its leader is gone: Linux allocates no pid that is still a process-group id, so a
group whose id has no live process of another start time is the recorded service's remainder.
Linux only (`/proc`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

LIVE_FILE = "live.json"


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (index 0 = field 3, the state)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return text[text.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot), None when there is no such process."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def running(pid: int, started: int) -> bool:
    """Whether `pid` is still the process that started at `started` and has not exited (a zombie has)."""
    fields = _stat(pid)
    return bool(fields) and int(fields[19]) == started and fields[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """The live (non-zombie) processes of process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


@dataclass(frozen=True)
class Member:
    """One process the launcher started, as recorded in the run directory."""

    role: str  # the service's tag: env, learner, rollout-0, scheduler
    pid: int
    start_time: int
    port: int = 0

    def running(self) -> bool:
        return running(self.pid, self.start_time)

    def owns_group(self) -> bool:
        """Whether process group `pid` is still this member's (its leader is it, or is gone)."""
        leader = start_time(self.pid)
        return leader is None or leader == self.start_time

    def leftovers(self) -> list[int]:
        """The live processes of this member's process group (itself included while it runs)."""
        return group_members(self.pid) if self.owns_group() else []


@dataclass(frozen=True)
class Record:
    """What live.json says: who launched, and the services it started."""

    launcher: Member
    services: list[Member] = field(default_factory=list)

    def alive(self) -> list[Member]:
        """The recorded services of which something still runs (the service or its group)."""
        return [m for m in self.services if m.leftovers()]


def read(run_dir: Path) -> Record | None:
    """The run directory's record; None when there is none (or it is unreadable: nothing to act on)."""
    try:
        data = json.loads((run_dir / LIVE_FILE).read_text())
        return Record(Member(**data["launcher"]), [Member(**s) for s in data["services"]])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write(run_dir: Path, record: Record) -> None:
    """Replace the record atomically (a reader sees the old one or the new one, never half)."""
    path = run_dir / LIVE_FILE
    tmp = path.with_name(f".{LIVE_FILE}.{os.getpid()}")
    data = {"launcher": asdict(record.launcher), "services": [asdict(m) for m in record.services]}
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def remove(run_dir: Path) -> None:
    (run_dir / LIVE_FILE).unlink(missing_ok=True)


def _signal(pid: int, signum: int, group: bool = False) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        (os.killpg if group else os.kill)(pid, signum)


def stop(
    members: Iterable[Member], grace_s: float = 10.0, say: Callable[[str], None] = print
) -> list[Member]:
    """Stop recorded services (blocking, at most `grace_s` plus a few seconds): SIGTERM + SIGCONT to
    each that still runs, SIGKILL to their process groups after the grace. Returns those of which a
    process was still alive at the end (normally none)."""
    members = [m for m in members if m.leftovers()]
    for member in members:
        if member.running():
            _signal(member.pid, signal.SIGTERM)
            _signal(member.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    while any(m.running() for m in members) and time.monotonic() < deadline:
        time.sleep(0.1)
    for member in members:
        if member.leftovers():
            if member.running():
                say(f"{member.role} (pid {member.pid}) ignored SIGTERM for {grace_s:g} s: SIGKILL")
            _signal(member.pid, signal.SIGKILL, group=True)
    deadline = time.monotonic() + 5.0  # SIGKILL is not refused; the kernel takes a moment
    while (left := [m for m in members if m.leftovers()]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
