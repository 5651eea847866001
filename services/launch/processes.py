"""Starting the services as local processes and stopping them the right way (SIGTERM to our own pids).

Each service runs in its own session (process group), so what it started (vLLM's engine processes)
can be stopped with it: `kill_leftovers` SIGKILLs the group we created, never anything found by name.
A process keeps the port it first bound, so a restart (`supervisor.py`) comes back where its peers
and the launcher look for it.

A service started here dies with the process that started it: the kernel sends it SIGTERM when that
process exits, SIGKILL included (`PR_SET_PDEATHSIG`, set in the child before it runs the service; if
the starter is already gone by then, the child stops itself). The kernel ties the signal to the
starting *thread*, so `start()` must run on the main thread. Services started by hand, by compose or
by Kubernetes run no code of this module and are not affected. `ownership.py` records each start in
the run directory and stops what is left, e.g. a service too hung to act on its SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpo.env.v1 import env_pb2
from grpo.learner.v1 import learner_pb2
from grpo.rollout.v1 import rollout_pb2
from grpo.scheduler.v1 import scheduler_pb2
from services.common.clients import GrpcClient
from services.common.errors import GrpoError
from services.common.parent_death import die_with_parent
from services.common.serve import service_names
from services.launch.liveset import Member, start_time

# The health-check name of each service: its readiness (the full service name, from the contract).
READINESS = {
    name: service_names(module)[0]
    for name, module in (
        ("env", env_pb2),
        ("rollout", rollout_pb2),
        ("learner", learner_pb2),
        ("scheduler", scheduler_pb2),
    )
}


def die_with(starter: int) -> Callable[[], None]:
    """The child's last step before it runs the service: SIGTERM when `starter` exits (Linux)."""
    return partial(die_with_parent, starter)


class ServiceFailed(RuntimeError):
    """A service process exited or never became ready; the message carries its log tail."""


@dataclass
class ServiceProcess:
    name: str
    run_dir: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    label: str = ""  # distinguishes several processes of one service (port and log file names)
    process: subprocess.Popen | None = None
    port: int = 0  # 0 until the first start has bound one; restarts reuse it
    starts: int = 0
    started_at: int | None = None  # the current process's start time (/proc/<pid>/stat), read at start
    die_with_starter: bool = True  # SIGTERM from the kernel when the starting process exits
    on_change: Callable[[], None] | None = None  # called after each start and once the port is known
    # a command of its own instead of `python -m services.<name>` (an external harness: no port, no
    # readiness); "http": a grpo-mesh HTTP service (the gateway), ready once GET /health answers 200
    command: list[str] = field(default_factory=list)
    readiness: str = "grpc"
    # what runs `services.<name>` as a module: this Python, or e.g. torchrun ending in "-m" (the learner's
    # ranks: `demo.learner_runner`)
    runner: list[str] = field(default_factory=lambda: [sys.executable, "-m"])

    @property
    def tag(self) -> str:
        return self.label or self.name

    @property
    def port_file(self) -> Path:
        return self.run_dir / f"{self.tag}.port"

    @property
    def metrics_port_file(self) -> Path:
        return self.run_dir / f"{self.tag}.metrics-port"

    def metrics_url(self) -> str:
        """Where this service's Prometheus metrics are (once it has written its metrics port)."""
        try:
            return f"http://127.0.0.1:{int(self.metrics_port_file.read_text())}/metrics"
        except (OSError, ValueError):
            return "(no metrics port)"

    @property
    def log_file(self) -> Path:
        return self.run_dir / "logs" / f"{self.tag}.log"

    def member(self) -> Member | None:
        """This service's current process as the run directory records it (None before a start). Its
        start time was read while the process was ours for sure (before we reaped it), so a later
        process that reuses the pid never passes for it."""
        if self.process is None or self.started_at is None:
            return None
        return Member(self.tag, self.process.pid, self.started_at, self.port)

    def start(self) -> None:
        """Start (or restart: same port, log appended) the service in a session of its own."""
        if self.die_with_starter and threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start() off the main thread: the death signal would follow that thread")
        self.port_file.unlink(missing_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        command = self.command or [
            *self.runner,
            f"services.{self.name}",
            "--port",
            str(self.port),
            "--port-file",
            str(self.port_file),
            "--telemetry.metrics-port-file",  # written only when metrics are on (telemetry.metrics_port)
            str(self.metrics_port_file),
            *self.args,
        ]
        with self.log_file.open("a" if self.starts else "w") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with(os.getpid()) if self.die_with_starter else None,
            )
        self.started_at = start_time(self.process.pid)  # unreaped, the pid cannot be anyone else's yet
        self.starts += 1
        if self.on_change:
            self.on_change()

    def signal_group(self, signum: int) -> None:
        """Signal the process group this service was started in (itself and its own children)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
            os.killpg(self.process.pid, signum)

    def group_alive(self) -> bool:
        if self.process is None:
            return False
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def kill_leftovers(self) -> None:
        """SIGKILL what is left of the service's process group."""
        self.signal_group(signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        if not self.log_file.exists():
            return ""
        return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise ServiceFailed(
                f"{self.tag} exited with code {self.process.returncode}; log tail:\n{self.log_tail()}"
            )

    @property
    def address(self) -> str:
        self.port = int(self.port_file.read_text())
        return f"127.0.0.1:{self.port}"

    async def wait_ready(self, timeout: float) -> str:  # noqa: ASYNC109 (a polling deadline, not a call's)
        """Wait for the port file, then for readiness SERVING on grpc.health.v1 (an HTTP service: 200
        from GET /health); returns host:port. A command of its own is ready once started ("")."""
        if self.command:
            self.check_alive()
            return ""
        deadline = time.monotonic() + timeout
        while not (self.port_file.exists() and self.port_file.read_text().strip()):
            self.check_alive()
            if time.monotonic() > deadline:
                raise ServiceFailed(
                    f"{self.name} did not bind a port within {timeout:.0f}s:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.2)
        if self.readiness == "http":
            return await self._wait_http(deadline, timeout)
        health = GrpcClient(self.address, health_pb2_grpc.HealthStub)
        try:
            while True:
                self.check_alive()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServiceFailed(f"{self.name} not ready within {timeout:.0f}s:\n{self.log_tail()}")
                try:
                    response = await health.unary(
                        "Check",
                        health_pb2.HealthCheckRequest(service=READINESS[self.name]),
                        min(5.0, remaining),
                    )
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        if self.on_change:
                            self.on_change()  # the port is known now
                        return self.address
                except GrpoError:
                    pass  # not listening yet or still loading: poll again until the deadline
                await asyncio.sleep(0.5)
        finally:
            await health.close()

    async def _wait_http(self, deadline: float, timeout: float) -> str:  # noqa: ASYNC109 (a polling deadline)
        url = f"http://{self.address}/health"
        async with httpx.AsyncClient() as client:
            while True:
                self.check_alive()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ServiceFailed(f"{self.name} not ready within {timeout:.0f}s:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(url, timeout=min(5.0, remaining))).status_code == 200:
                        if self.on_change:
                            self.on_change()
                        return self.address
                await asyncio.sleep(0.5)

    def ask_to_stop(self) -> None:
        """SIGTERM this process (our own pid) without waiting for it."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def terminate(self, grace: float = 30.0) -> int | None:
        """SIGTERM this process (our own pid, never by name); SIGKILL only if it ignores the grace period."""
        if self.process is None:
            return None
        if self.process.poll() is not None:
            self.kill_leftovers()
            return self.process.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self.kill_leftovers()
        return code


def terminate_all(processes: list[ServiceProcess], grace: float = 30.0) -> None:
    """Stop `processes` in order, all asked at once: each gets SIGTERM now, then each is waited for
    in turn (SIGKILL when the shared grace period is over), so services that are slow to stop (a model
    loading when the launcher was told to stop) take one grace period together, not one each."""
    for proc in processes:
        proc.ask_to_stop()
    deadline = time.monotonic() + grace
    for proc in processes:
        proc.terminate(grace=max(0.5, deadline - time.monotonic()))
