"""A Python sandbox a policy may call: `run_python(code, limits)` and the `python(code)` tool.

Each run is a fresh process (`python -I -S -u sandbox_boot.py`: isolated mode, no site, no user paths),
started in its own session and process group, with an empty environment, a fresh temporary working
directory (deleted afterwards) and the code on stdin. The event loop only awaits it.

What enforces what:

| limit                        | enforced by                                                          |
|------------------------------|----------------------------------------------------------------------|
| no network                   | a new network namespace (only a down loopback) when the kernel       |
|                              | allows `unshare` (user namespaces, or root); always also the audit   |
|                              | hook, which refuses creating, connecting, binding sockets and DNS    |
| read-only file system        | a new mount namespace in which every mount is read-only except the   |
|                              | working directory (`mount_setattr`, Linux >= 5.12) when allowed;     |
|                              | always also the audit hook, which refuses opening for writing,       |
|                              | removing, renaming, chmod... outside the working directory, links,   |
|                              | and chdir                                                            |
| no processes / fork bombs    | the audit hook (os.fork, posix_spawn, exec, system, subprocess,      |
|                              | and importing _posixsubprocess are refused); RLIMIT_NPROC too, which |
|                              | does not bind for root: there the hook is what stops a fork bomb     |
| no signals to others         | the audit hook (os.kill, os.killpg, pthread_kill)                    |
| no native code               | the audit hook (ctypes imports and calls, test C-API modules)        |
| CPU time                     | RLIMIT_CPU (SIGXCPU, then SIGKILL one second later)                  |
| memory                       | RLIMIT_AS (an allocation over it raises MemoryError)                 |
| file size, open files        | RLIMIT_FSIZE, RLIMIT_NOFILE; RLIMIT_CORE = 0                         |
| wall clock                   | the parent kills the process group (SIGKILL) at the deadline         |
| output                       | the parent reads at most `output_bytes` per stream, then kills       |
| environment                  | an empty environment, `-I` (no PYTHON* variables, no user site)      |

`SandboxResult.layers` says which of namespaces, read-only mounts, rlimits and the audit hook were
applied to a run.

What is NOT enforced: the audit hook is a tripwire, not a boundary (PEP 578 says so): code that
reaches native code or crafts bytecode (e.g. through `marshal`) can remove it, and without the
namespaces (containers that forbid `unshare`, kernels before 5.12 for the read-only mounts) it is the
only file-system and network guard. Reading is not restricted: the code can read whatever the
service's user can read (run the service as an unprivileged user with no secrets in readable files).
No PID namespace, no seccomp filter, no cgroup: memory is bounded per process by RLIMIT_AS, not by a
cgroup. A determined attacker with a kernel exploit is out of scope. Usability cost of the hook:
writes must name their path as a str (`open("f.txt", "w")`); a `pathlib.Path` is refused, because a
path-like object could answer the check and the open differently; and calls relative to a directory
descriptor (`dir_fd=`, which `shutil.rmtree` uses) and `os.open` for writing with a relative path are
refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

BOOT = Path(__file__).with_name("sandbox_boot.py")
KILL_GRACE_SECONDS = 15.0  # to reap a killed process and drain its pipes


class SandboxLimits(BaseModel):
    """The limits of one sandbox run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_seconds: float = Field(10.0, gt=0, le=600, description="Killed after this many seconds.")
    cpu_seconds: int = Field(5, ge=1, le=600, description="CPU time limit (RLIMIT_CPU).")
    memory_bytes: int = Field(512 * 2**20, ge=64 * 2**20, description="Address space limit (RLIMIT_AS).")
    file_size_bytes: int = Field(16 * 2**20, ge=0, description="Largest file it may write (RLIMIT_FSIZE).")
    max_processes: int = Field(64, ge=1, description="RLIMIT_NPROC (threads count; root is exempt).")
    max_open_files: int = Field(64, ge=16, description="RLIMIT_NOFILE.")
    output_bytes: int = Field(64 * 1024, ge=1, description="Bytes kept of stdout and of stderr each.")
    max_code_chars: int = Field(100_000, ge=1, description="Longer code is refused without running.")
    isolate: bool = Field(True, description="Network and mount namespaces when the kernel allows them.")
    audit_hook: bool = Field(True, description="The audit hook; off only to test the OS layers alone.")


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended: exit_code is None when it was killed (by a signal, a limit or the parent) or never
    ran; killed_reason then says why."""

    stdout: str
    stderr: str
    exit_code: int | None
    killed_reason: str | None  # wall_timeout, cpu_time, output_limit, signal <NAME>, code_too_long
    layers: tuple[str, ...] = ()


async def _read_bounded(stream: asyncio.StreamReader, limit: int, overflow: asyncio.Event) -> bytes:
    """The first `limit` bytes of the stream; past them `overflow` is set and the rest is read and
    dropped until EOF. It must be read: a reader that stopped would leave asyncio's pipe paused, never
    at EOF, and `process.wait()` waits for the pipes too, so the killed process was never reaped."""
    kept = bytearray()
    while chunk := await stream.read(65536):
        room = limit - len(kept)
        if room > 0:
            kept += chunk[:room]
        if len(chunk) > room:
            overflow.set()
    return bytes(kept)


def _kill_group(process: asyncio.subprocess.Process) -> None:
    if process.returncode is not None:
        return  # reaped: its pid (and group id) may belong to someone else now
    for kill in (lambda: os.killpg(process.pid, signal.SIGKILL), process.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            kill()


def _reason(returncode: int | None, killed: str | None) -> str | None:
    if killed is not None:
        return killed
    if returncode is None or returncode >= 0:
        return None
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # the soft, then the hard CPU limit
        return "cpu_time"
    return f"signal {signal.Signals(-returncode).name}" if -returncode in signal.valid_signals() else "signal"


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` in a fresh sandboxed process and return what it printed and how it ended."""
    limits = limits or SandboxLimits()
    if len(code) > limits.max_code_chars:
        return SandboxResult(
            "", f"code is {len(code)} characters, at most {limits.max_code_chars}", None, "code_too_long"
        )
    work = await asyncio.to_thread(lambda: os.path.realpath(tempfile.mkdtemp(prefix="grpo-sandbox-")))
    status_read, status_write = os.pipe()
    try:
        config = {**limits.model_dump(), "work": work, "status_fd": status_write}
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-I", "-S", "-u", "-X", "utf8", str(BOOT), json.dumps(config),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                cwd=work, env={}, start_new_session=True, pass_fds=(status_write,),
            )  # fmt: skip
        finally:
            os.close(status_write)
        result = await _supervise(process, code.encode("utf-8", "surrogatepass"), limits)
        return SandboxResult(*result, layers=_read_layers(status_read))
    finally:
        os.close(status_read)
        await asyncio.to_thread(shutil.rmtree, work, True)


async def _supervise(
    process: asyncio.subprocess.Process, code: bytes, limits: SandboxLimits
) -> tuple[str, str, int | None, str | None]:
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    overflow = asyncio.Event()
    readers = [
        asyncio.create_task(_read_bounded(stream, limits.output_bytes, overflow))
        for stream in (process.stdout, process.stderr)
    ]
    killed: str | None = None
    deadline = time.monotonic() + limits.wall_seconds
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            async with asyncio.timeout(limits.wall_seconds):
                process.stdin.write(code)
                await process.stdin.drain()
            process.stdin.close()
        waiters = {asyncio.ensure_future(process.wait()), asyncio.ensure_future(overflow.wait())}
        try:
            await asyncio.wait(
                waiters, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waiters:
                waiter.cancel()
        if process.returncode is None:
            killed = "output_limit" if overflow.is_set() else "wall_timeout"
    except TimeoutError:
        killed = "wall_timeout"
    finally:
        if process.returncode is None:
            _kill_group(process)
        try:
            async with asyncio.timeout(KILL_GRACE_SECONDS):
                await process.wait()
                stdout, stderr = await asyncio.gather(*readers)
        except TimeoutError:  # a loaded machine reaps the killed group late: never raise, report it
            for reader in readers:
                reader.cancel()
            stdout, stderr = b"", f"the sandbox was not reaped within {KILL_GRACE_SECONDS:g} s".encode()
            killed = killed or "wall_timeout"
    if overflow.is_set() and killed is None:
        killed = "output_limit"
    text = [data.decode("utf-8", "replace") for data in (stdout, stderr)]
    code_ = process.returncode
    exit_code = code_ if killed is None and code_ is not None and code_ >= 0 else None
    return text[0], text[1], exit_code, _reason(code_, killed)


def _read_layers(status_read: int) -> tuple[str, ...]:
    """The layers the child reported; it has exited, so the read never blocks."""
    os.set_blocking(status_read, False)
    with contextlib.suppress(BlockingIOError, OSError):
        line = os.read(status_read, 4096).decode()
        with contextlib.suppress(ValueError, AttributeError):
            return tuple(json.loads(line).get("layers", ()))
    return ()


def format_result(result: SandboxResult, limits: SandboxLimits) -> str:
    """The tool's answer to the model: stdout, then stderr, then how it ended when not cleanly."""
    parts = [result.stdout] if result.stdout else []
    if result.stderr:
        parts.append(f"[stderr]\n{result.stderr}")
    reasons = {
        "wall_timeout": f"killed: took longer than {limits.wall_seconds:g} s",
        "cpu_time": f"killed: used more than {limits.cpu_seconds} s of CPU time",
        "output_limit": f"killed: printed more than {limits.output_bytes} bytes",
        "code_too_long": "not run: the code is too long",
    }
    if result.killed_reason:
        parts.append(f"[{reasons.get(result.killed_reason, 'killed: ' + result.killed_reason)}]")
    elif result.exit_code:
        parts.append(f"[exit status {result.exit_code}]")
    return "\n".join(part.rstrip("\n") for part in parts) if parts else "(no output)"


_PYTHON_DOC = """Run Python code in a sandbox and return what it printed.

    A fresh process each call: no network, no files outside its own temporary directory, no
    subprocesses, {wall:g} s of wall-clock time, {cpu} s of CPU time and {memory} MiB of memory. Print the
    values you need; nothing is kept between calls.

    Args:
        code: The Python source to run, for example "print(sum(range(10)))".
    """


def python_tool(limits: SandboxLimits) -> Callable[[str], Awaitable[str]]:
    """A `python` tool with these limits (its description states them)."""

    async def python(code: str) -> str:
        return format_result(await run_python(code, limits), limits)

    python.__doc__ = _PYTHON_DOC.format(
        wall=limits.wall_seconds, cpu=limits.cpu_seconds, memory=limits.memory_bytes // 2**20
    )
    return python


DEFAULT_LIMITS = SandboxLimits()
python = python_tool(DEFAULT_LIMITS)  # the tool with the default limits
