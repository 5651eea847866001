"""Restarting crashed services, the way a process supervisor (or compose's `restart:`) would.

The launcher polls `Supervisor.check()`. A service process that exited although nobody stopped it
is logged; what is left of its process group (vLLM's engine processes) gets SIGTERM, so vLLM shuts
down and frees its shared memory, and SIGKILL when the restart is due if it is still there after
`leftover_grace_s`. The service is then started again with the same arguments on the same port,
after a back-off (`backoff_s`, doubling per restart of that service, at most `backoff_max_s`). More
than `max_restarts` restarts of one service within `window_s` seconds end the run with
`ServiceFailed`: a service that cannot stay up is not hidden. The restarted services rejoin by
themselves: the scheduler waits for peers that went away and recovers from its ledger when it is
the one restarted (docs/recovery.md).
"""

from __future__ import annotations

import signal
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.launch.processes import ServiceFailed, ServiceProcess


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    leftover_grace_s: float = 10.0


class Supervisor:
    def __init__(
        self, processes: Iterable[ServiceProcess], policy: RestartPolicy, say: Callable[[str], None] = print
    ) -> None:
        self.processes = list(processes)
        self.policy = policy
        self.say = say
        self.restarts: Counter[str] = Counter()
        self._recent: dict[str, deque[float]] = defaultdict(deque)
        self._due: dict[str, float] = {}  # tag → when its restart is due
        self._died_at: dict[str, float] = {}

    def add(self, process: ServiceProcess) -> None:
        self.processes.append(process)

    def check(self) -> None:
        """Restart every service that died (once its back-off has passed); raise if one keeps dying."""
        now = time.monotonic()
        for proc in self.processes:
            if proc.process is None or proc.process.poll() is None:
                continue
            tag = proc.tag
            if tag not in self._due:
                self._died(proc, now)
            elif now >= self._due[tag]:
                if proc.group_alive() and now - self._died_at[tag] < self.policy.leftover_grace_s:
                    continue  # its engine processes are still shutting down
                proc.kill_leftovers()
                del self._due[tag]
                proc.start()
                self.restarts[tag] += 1
                self.say(f"restarted {tag} (restart {self.restarts[tag]}, port {proc.port})")

    def _died(self, proc: ServiceProcess, now: float) -> None:
        code = proc.process.returncode if proc.process else None
        proc.signal_group(signal.SIGTERM)
        self._died_at[proc.tag] = now
        recent = self._recent[proc.tag]
        recent.append(now)
        while recent and now - recent[0] > self.policy.window_s:
            recent.popleft()
        if len(recent) > self.policy.max_restarts:
            raise ServiceFailed(
                f"{proc.tag} exited with code {code} for the {len(recent)}th time within "
                f"{self.policy.window_s:g} s (restart limit {self.policy.max_restarts}); log tail:\n"
                f"{proc.log_tail()}"
            )
        delay = min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** (len(recent) - 1))
        self._due[proc.tag] = now + delay
        self.say(f"{proc.tag} exited with code {code}; restarting it in {delay:g} s")
