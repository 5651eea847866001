"""The soak's hands on the run's processes (bench/soak.py): find a service, freeze or kill it, and
remember every process and /dev/shm segment the run had, to check afterwards that none is left.

A service is found among the launcher's own children by its command line: `ServiceProcess.start`
(services/launch/processes.py) runs `python -m services.<name> --port-file <run_dir>/<tag>.port`, so
the port file names the tag (env, learner, scheduler, rollout-<i>). Never by process name: another
run on the machine has the same names. Signals go to pids seen in this run's tree only; psutil
refuses a pid that was reused by another process since it was seen.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

SHM = Path("/dev/shm")


def service_tag(cmdline: list[str], run_dir: Path) -> str | None:
    """The launcher tag of a service process of the run in `run_dir` (absolute), from its command line
    (`python -m services.<name> ... --port-file <run_dir>/<tag>.port ...`); None for anything else."""
    if "-m" not in cmdline or "--port-file" not in cmdline:
        return None
    module = cmdline[cmdline.index("-m") + 1] if cmdline.index("-m") + 1 < len(cmdline) else ""
    at = cmdline.index("--port-file") + 1
    if not module.startswith("services.") or at >= len(cmdline):
        return None
    port_file = Path(cmdline[at])
    if port_file.parent != run_dir or port_file.suffix != ".port":
        return None
    return port_file.stem


def find_service(launcher: psutil.Process, run_dir: Path, tag: str) -> psutil.Process | None:
    """The launcher's live child running service `tag` of this run (None while it is being restarted)."""
    try:
        children = launcher.children()
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE and service_tag(child.cmdline(), run_dir) == tag:
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def tree(root: psutil.Process) -> list[psutil.Process]:
    """`root` and every process under it (vLLM's engine core, multiprocessing helpers)."""
    try:
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def freeze(root: psutil.Process) -> list[psutil.Process]:
    """SIGSTOP `root`, then everything under it (root first: a stopped parent starts no new child;
    passes repeat until no new descendant shows up). Returns the processes stopped, for `thaw`."""
    stopped: list[psutil.Process] = []
    seen: set[int] = set()
    for _ in range(5):
        fresh = [p for p in tree(root) if p.pid not in seen]
        if not fresh:
            break
        for process in fresh:
            seen.add(process.pid)
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                process.suspend()
                stopped.append(process)
    return stopped


def thaw(processes: Iterable[psutil.Process]) -> None:
    """SIGCONT what `freeze` stopped, children first and the root last (gone ones skipped)."""
    for process in reversed(list(processes)):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.resume()


def kill_group(root: psutil.Process) -> list[psutil.Process]:
    """SIGKILL the process group `root` leads (the launcher starts each service in a session of its own:
    the service and what it started, as `kill -9 -PGID` would); returns the tree it had."""
    victims = tree(root)
    try:
        pgid = os.getpgid(root.pid)
    except ProcessLookupError:
        return victims
    if pgid == root.pid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    else:  # not a group leader: never signal a group we did not see it lead
        with contextlib.suppress(psutil.NoSuchProcess):
            root.kill()
    return victims


def shm_segments() -> set[str]:
    """The names in /dev/shm now."""
    try:
        return set(os.listdir(SHM))
    except OSError:
        return set()


def shm_in_use(pid: int) -> set[str]:
    """The /dev/shm names process `pid` maps or holds open (unreadable or gone: none)."""
    names: set[str] = set()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            at = line.find("/dev/shm/")
            if at >= 0:
                names.add(line[at + 9 :].strip().removesuffix(" (deleted)"))
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    names.add(target[9:].removesuffix(" (deleted)"))
    return names


class TreeWatch:
    """Every process seen under the launcher (keyed by pid and start time, so a reused pid is a new
    entry) and every /dev/shm name one of them mapped or held open, from `sample()` calls. Processes
    and segments that live less than one sampling interval can be missed; the services, vLLM's engine
    processes, weight segments and vLLM's message queues live much longer."""

    def __init__(self, root: psutil.Process) -> None:
        self.root = root
        self.seen: dict[tuple[int, float], psutil.Process] = {}
        self.shm: set[str] = set()

    def sample(self, shm: bool = True) -> None:
        for process in tree(self.root):
            with contextlib.suppress(psutil.NoSuchProcess):
                self.seen.setdefault((process.pid, process.create_time()), process)
        if shm:
            for process in self.alive():
                self.shm |= shm_in_use(process.pid)

    def alive(self) -> list[psutil.Process]:
        """Seen processes still running (zombies are dead: only their exit status is left)."""
        alive = []
        for process in self.seen.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                    alive.append(process)
        return alive

    def leftovers(self, grace: float) -> list[psutil.Process]:
        """Seen processes still running after waiting up to `grace` seconds for them to exit (polled:
        a process that is not our child cannot be waited for, and a zombie counts as gone)."""
        deadline = time.monotonic() + grace
        while (alive := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return alive


def describe(process: psutil.Process) -> str:
    """pid and command line, for a report line."""
    try:
        return f"{process.pid} {' '.join(process.cmdline())[:160]}"
    except psutil.Error:
        return f"{process.pid} (gone)"


def kill_all(processes: Iterable[psutil.Process]) -> None:
    """SIGCONT then SIGKILL each of these (leftovers of our own run, by pid)."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            process.resume()
            process.kill()
