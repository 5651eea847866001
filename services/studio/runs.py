"""The runs a studio knows: listed from run directories, started from the form, reached live through
the scheduler's gRPC API (GetStatus, Pause, Resume) and, once the scheduler is gone, read from the
run's record.

A run is its directory. The studio lists every directory under `--runs-root` that holds a run
(run.toml, metrics.jsonl or a ledger) and every `--run-dir`. The scheduler is found the way
`grpo-mesh status --run-dir` finds it: the port file the launcher writes, and the run's TLS material
and token when its run.toml has a `[security]` table. It is looked up again on every call, so a
scheduler restarted by the launcher is found again, and while none answers the run shows as
unreachable (with its last known state) instead of failing the page.

A run started from the form is `grpo-mesh demo --run-dir <runs-root>/<name> ...` in a session of its
own, a child of the studio: Stop sends SIGTERM to that process (the launcher then stops every
service cleanly), never to a process found by name. Runs the studio did not start can be paused and
resumed, not stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.clients import GrpcClient
from services.common.errors import FailedPrecondition, GrpoError, NotFound, Unavailable
from services.common.parent_death import die_with_parent
from services.launch import liveset
from services.scheduler.ledger.run_record import has_record, read_record
from services.scheduler.status_view import resolve_address, run_security
from services.studio.form import StartForm, demo_argv

RUN_FILES = ("run.toml", "metrics.jsonl", "ledger.sqlite")


@dataclass
class Launched:
    """A run this studio started: its `grpo-mesh demo` process."""

    process: subprocess.Popen
    argv: list[str]
    started_at: float = field(default_factory=time.time)

    @property
    def exit_code(self) -> int | None:
        return self.process.poll()


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / name).exists() for name in RUN_FILES)


class Runs:
    """Every run the studio shows, by id (the directory's name; `--run-dir`s by their path)."""

    def __init__(
        self, runs_root: Path, run_dirs: list[Path], call_timeout_s: float, control_wait_s: float = 30.0
    ) -> None:
        self.runs_root = runs_root
        self.extra = [p.resolve() for p in run_dirs]
        self.call_timeout_s = call_timeout_s
        self.control_wait_s = control_wait_s
        self.launched: dict[str, Launched] = {}

    # ---- which runs ---------------------------------------------------------------------------

    def all(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        if self.runs_root.is_dir():
            for path in sorted(self.runs_root.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
                if is_run_dir(path) or path.name in self.launched:
                    found[path.name] = path.resolve()
        for path in self.extra:
            if path not in found.values():  # a --run-dir under --runs-root is listed once
                found.setdefault(path.name if path.name not in found else str(path), path)
        return found

    def path(self, run_id: str) -> Path:
        path = self.all().get(run_id)
        if path is None:
            raise NotFound(f"no run {run_id!r} (runs are listed at /api/runs)")
        return path

    # ---- starting and stopping ----------------------------------------------------------------

    def new_name(self, form: StartForm) -> str:
        if form.name:
            if (self.runs_root / form.name).exists():
                raise FailedPrecondition(f"{self.runs_root / form.name} exists: choose another name")
            return form.name
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name, n = f"run-{stamp}", 1
        while (self.runs_root / name).exists():
            n += 1
            name = f"run-{stamp}-{n}"
        return name

    def start(self, form: StartForm) -> str:
        """Start `grpo-mesh demo` for the form in a new run directory; its id."""
        name = self.new_name(form)
        run_dir = (self.runs_root / name).resolve()
        run_dir.mkdir(parents=True)
        argv = [sys.executable, "-m", "services", "demo", *demo_argv(form, str(run_dir))]
        with (run_dir / "studio-launch.log").open("w") as log:
            process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                # SIGTERM to the demo (which stops its services) when the studio dies, kill -9 included;
                # armed for the thread that starts it: the async route runs on the main thread
                preexec_fn=partial(die_with_parent, os.getpid()),
            )
        self.launched[name] = Launched(process, argv)
        return name

    def stop(self, run_id: str) -> None:
        """SIGTERM to the demo this studio started for `run_id` (it stops its services cleanly)."""
        launched = self.launched.get(run_id)
        if launched is None:
            raise FailedPrecondition(
                f"run {run_id!r} was not started by this studio: stop it where it was started "
                "(pause and resume work here)"
            )
        if launched.exit_code is None:
            with contextlib.suppress(ProcessLookupError):
                launched.process.send_signal(signal.SIGTERM)

    async def close(self, grace_s: float = 30.0) -> None:
        """Stop every run this studio started and still runs (the studio is shutting down)."""
        running = [r for r in self.launched.values() if r.exit_code is None]
        for launched in running:
            with contextlib.suppress(ProcessLookupError):
                launched.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(r.exit_code is None for r in running) and time.monotonic() < deadline:  # noqa: ASYNC110 (child exits)
            await asyncio.sleep(0.2)

    # ---- the live scheduler -------------------------------------------------------------------

    def _client(self, run_dir: Path) -> GrpcClient:
        address = resolve_address("", run_dir)  # FileNotFoundError: no port file (yet, or any more)
        return GrpcClient(address, scheduler_pb2_grpc.SchedulerServiceStub, security=run_security(run_dir))

    async def call(self, run_id: str, method: str, request: Any) -> Any:
        run_dir = self.path(run_id)
        try:
            client = self._client(run_dir)
        except FileNotFoundError as exc:
            raise FailedPrecondition(f"run {run_id!r} has no scheduler running ({exc})") from None
        try:
            return await client.unary(method, request, timeout=self.call_timeout_s)
        except GrpoError as exc:
            if exc.unreachable:
                raise Unavailable(f"run {run_id!r}: its scheduler does not answer ({exc})") from exc
            raise
        finally:
            await client.close()

    async def status(self, run_id: str) -> scheduler_pb2.GetStatusResponse:
        return await self.call(run_id, "GetStatus", scheduler_pb2.GetStatusRequest())

    async def pause(self, run_id: str, paused: bool) -> bool:
        """Pause (or Resume) the run's scheduler. While its launcher lives but the scheduler does not
        answer (the launcher is restarting it, or starting the run), the call is made again until it
        answers, for up to `control_wait_s`: a click during a restart takes effect once the scheduler
        is back (and a restarted scheduler keeps a pause it had, from its ledger)."""
        method, request = ("Pause", scheduler_pb2.PauseRequest()) if paused else (
            "Resume", scheduler_pb2.ResumeRequest())  # fmt: skip
        deadline = time.monotonic() + self.control_wait_s
        while True:
            try:
                return (await self.call(run_id, method, request)).paused
            except (Unavailable, FailedPrecondition):
                if time.monotonic() >= deadline or not self._launcher_alive(run_id):
                    raise
            await asyncio.sleep(0.5)

    def _launcher_alive(self, run_id: str) -> bool:
        live = liveset.read(self.path(run_id))
        return live is not None and live.launcher.running()

    async def state(self, run_id: str) -> dict[str, Any]:
        """What the run page shows at the top: the phase, GetStatus as JSON (live, or rebuilt from the
        record), why it is not live, and this studio's own process for it."""
        run_dir = self.path(run_id)
        launched = self.launched.get(run_id)
        services = _services(run_dir)
        process = None
        if launched is not None:
            process = {
                "exit_code": launched.exit_code,
                "argv": launched.argv[3:],
                "pid": launched.process.pid,
            }
        try:
            status = await self.status(run_id)
            phase = "failed" if status.error else "finished" if status.finished else (
                "paused" if status.paused else "running")  # fmt: skip
            return {"id": run_id, "dir": str(run_dir), "live": True, "phase": phase, "why": "",
                    "status": _as_dict(status), "process": process, "services": services}  # fmt: skip
        except (GrpoError, FailedPrecondition) as exc:
            why = str(exc)
        phase, status_dict = await asyncio.to_thread(self._offline_phase, run_dir, launched)  # SQLite
        return {"id": run_id, "dir": str(run_dir), "live": False, "phase": phase, "why": why,
                "status": status_dict, "process": process, "services": services}  # fmt: skip

    def _offline_phase(self, run_dir: Path, launched: Launched | None) -> tuple[str, dict[str, Any]]:
        """The phase of a run whose scheduler does not answer: starting (our demo is still coming up),
        unreachable (its launcher is alive: a restart is under way), or how its record says it ended
        (finished, failed, stopped; crashed when the record has no ending and nothing runs it)."""
        record = None
        if has_record(run_dir) and (run_dir / "ledger.sqlite").exists():
            with contextlib.suppress(Exception):  # a ledger being created; an old-format run
                record = read_record(run_dir)
        status_dict = _as_dict(record.status) if record is not None else {}
        if launched is not None and launched.exit_code is None:
            return ("starting" if record is None else "unreachable"), status_dict
        if record is not None and record.ending:
            return record.ending, status_dict
        live = liveset.read(run_dir)
        if launched is None and live is not None and live.launcher.running():
            return "unreachable", status_dict  # its launcher (elsewhere) is alive: restarting it
        if launched is not None and (launched.exit_code or 0) > 0:
            return "failed", status_dict  # the launcher gave up (e.g. a service failed to start)
        return ("crashed" if record is not None else "empty"), status_dict


def _services(run_dir: Path) -> list[dict[str, Any]]:
    """The launcher's record of the processes it runs (a restart rewrites it): role, pid, running."""
    live = liveset.read(run_dir)
    return [{"role": m.role, "pid": m.pid, "running": m.running()} for m in (live.services if live else [])]


def _as_dict(message: Any) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
