"""The Python sandbox, with real processes: each limit holds, and the tool stays usable afterwards.

Hostile code runs with every layer on (what a policy gets) and, where the kernel allows namespaces,
also against one layer alone (the OS namespaces without the audit hook, the audit hook without the
namespaces), so each layer is proven by itself. A fork bomb only ever runs with the audit hook on.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.common.tool_calls import ParsedCall
from services.env.tools import SandboxLimits, Toolbox, python, python_tool, run_python
from services.env.tools.sandbox import SandboxResult

ALL = SandboxLimits(wall_seconds=30, cpu_seconds=10)
HOOK_ONLY = ALL.model_copy(update={"isolate": False})
OS_ONLY = ALL.model_copy(update={"audit_hook": False})


async def namespaces_available() -> bool:
    return "read-only-mounts" in (await run_python("pass", ALL)).layers


async def assert_still_usable() -> None:
    result = await run_python("print(2+2)", ALL)
    assert (result.stdout, result.exit_code, result.killed_reason) == ("4\n", 0, None), result


async def layer_settings(which: str) -> SandboxLimits:
    if which == "os" and not await namespaces_available():
        pytest.skip("this kernel or container does not allow user/mount/network namespaces")
    return {"all": ALL, "hook": HOOK_ONLY, "os": OS_ONLY}[which]


async def test_a_normal_run_has_every_layer_an_empty_environment_and_a_deleted_directory() -> None:
    code = "import os\nprint(os.getcwd())\nprint(dict(os.environ))\nopen('f.txt', 'w').write('hi')\n"
    code += "print(open('f.txt').read())"
    result = await run_python(code, ALL)
    cwd, environment, text = result.stdout.splitlines()
    assert result.exit_code == 0 and environment == "{}" and text == "hi", result
    assert {"rlimits", "audit-hook"} <= set(result.layers)
    assert not await asyncio.to_thread(Path(cwd).exists)  # the working directory is gone after the run


async def test_a_fork_bomb_fails_cleanly() -> None:
    for limits in (ALL, HOOK_ONLY):
        result = await run_python("import os\nwhile True: os.fork()", limits)
        assert result.exit_code == 1 and result.killed_reason is None
        assert "PermissionError: sandbox: os.fork is not allowed" in result.stderr
    for code in ("import subprocess\nsubprocess.run(['true'])", "import os\nos.system('true')"):
        assert "is not allowed" in (await run_python(code, ALL)).stderr
    await assert_still_usable()


async def test_an_infinite_loop_is_stopped_by_the_cpu_limit_and_by_the_wall_clock() -> None:
    result = await run_python("while True: pass", ALL.model_copy(update={"cpu_seconds": 1}))
    assert (result.exit_code, result.killed_reason) == (None, "cpu_time"), result
    sleeper = ALL.model_copy(update={"wall_seconds": 3.0})
    result = await run_python("import time\nprint('started', flush=True)\ntime.sleep(600)", sleeper)
    assert (result.exit_code, result.killed_reason) == (None, "wall_timeout"), result
    assert result.stdout == "started\n"  # what it printed before it was killed comes back
    await assert_still_usable()


async def test_a_10_gb_allocation_fails_with_memory_error() -> None:
    result = await run_python("b = bytearray(10 * 2**30)\nprint('allocated')", ALL)
    assert result.exit_code == 1 and "MemoryError" in result.stderr and "allocated" not in result.stdout
    await assert_still_usable()


@pytest.mark.parametrize("which", ["all", "hook", "os"])
async def test_a_socket_connect_reaches_nothing(which: str) -> None:
    limits = await layer_settings(which)
    connections = 0

    async def count(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        writer.close()

    server = await asyncio.start_server(count, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        code = f"import socket\ns = socket.socket()\ns.settimeout(5)\ns.connect(('127.0.0.1', {port}))\n"
        result = await run_python(code + "print('connected')", limits)
        await asyncio.sleep(0.2)  # a connection that got through would be accepted by now
    finally:
        server.close()
        await server.wait_closed()
    assert connections == 0 and result.exit_code == 1 and "connected" not in result.stdout, result
    expected = "Network is unreachable" if which == "os" else "sandbox: socket.__new__ is not allowed"
    assert expected in result.stderr
    await assert_still_usable()


@pytest.mark.parametrize("which", ["all", "hook", "os"])
async def test_a_write_outside_its_directory_fails(tmp_path: Path, which: str) -> None:
    limits = await layer_settings(which)
    target = tmp_path / "escaped.txt"
    existing = tmp_path / "existing.txt"
    existing.write_text("keep")
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.remove({str(existing)!r})",
        f"import os\nos.mkdir({str(tmp_path / 'made')!r})",
        f"import os\nos.rename({str(existing)!r}, 'stolen.txt')",
        f"open('/proc/self/cwd/../{target.name}', 'w')",
    ]
    if which != "os":  # tricks aimed at the audit hook's path check
        attempts += [
            f"import os\nd = os.open({str(tmp_path)!r}, os.O_RDONLY)\n"
            "os.open('escaped.txt', os.O_WRONLY | os.O_CREAT, dir_fd=d)",
            f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/escaped.txt', 'w')",
            f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        ]
    for code in attempts:
        result = await run_python(code, limits)
        assert result.exit_code == 1, (code, result)
        refusals = ("PermissionError", "Read-only file system", "Invalid cross-device link")
        assert any(refusal in result.stderr for refusal in refusals), (code, result)
    left = await asyncio.to_thread(lambda: sorted(p.name for p in tmp_path.iterdir()))
    assert left == ["existing.txt"] and existing.read_text() == "keep"
    await assert_still_usable()


async def test_the_audit_hook_ignores_patched_builtins_and_bootstrap_globals(tmp_path: Path) -> None:
    target, existing = tmp_path / "escaped.txt", tmp_path / "existing.txt"
    existing.write_text("keep")
    tamper_globals = (
        "import sys\ng = sys._getframe(1).f_globals\n"
        "g['WRITE_FLAGS'] = 0\ng['PATH_EVENTS'].clear()\ng['BLOCKED_EVENTS'] = frozenset()\n"
    )
    attempts = [
        f"import os\nimport builtins\nbuiltins.type = lambda obj: int\nopen({str(target)!r}, 'w').write('x')",
        f"{tamper_globals}import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"{tamper_globals}import os\nos.remove({str(existing)!r})",
        "import os, posixpath\nposixpath.normpath = os.path.realpath = lambda p: os.getcwd()\n"
        f"open({str(target)!r}, 'w').write('x')",
    ]
    for code in attempts:
        result = await run_python(code, HOOK_ONLY)
        assert result.exit_code != 0 and "sandbox:" in result.stderr, (code, result)
    left = await asyncio.to_thread(lambda: sorted(p.name for p in tmp_path.iterdir()))
    assert left == ["existing.txt"] and existing.read_text() == "keep"


async def test_other_escapes_are_refused() -> None:
    for code in (
        "import ctypes",
        "import os\nos.kill(1, 0)",
        "import resource\nresource.setrlimit(0, (-1, -1))",
    ):
        result = await run_python(code, ALL)
        assert result.exit_code == 1 and "sandbox:" in result.stderr, (code, result)


async def test_output_and_file_size_are_bounded() -> None:
    limits = ALL.model_copy(update={"output_bytes": 1000, "file_size_bytes": 2**20})
    result = await run_python("while True: print('x' * 1000)", limits)
    assert result.killed_reason == "output_limit" and len(result.stdout) == 1000
    result = await run_python("open('big', 'wb').write(b'x' * 2**21)", limits)
    assert result.exit_code == 1 and "File too large" in result.stderr
    result = await run_python("x" * 200, limits.model_copy(update={"max_code_chars": 100}))
    assert result.killed_reason == "code_too_long" and result.exit_code is None
    await assert_still_usable()


async def test_the_event_loop_runs_while_the_sandbox_does() -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    task = asyncio.create_task(ticker())
    result = await run_python("import time\ntime.sleep(1.5)\nprint('slept')", ALL)
    task.cancel()
    assert result.stdout == "slept\n" and ticks >= 10


async def test_concurrent_runs_are_independent() -> None:
    results = await asyncio.gather(*(run_python(f"print({i} * {i})", ALL) for i in range(4)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(4)]


async def test_the_python_tool_through_a_toolbox() -> None:
    box = Toolbox([python])
    code = "import math\nprint(math.factorial(30))"
    call = ParsedCall("call_0", "python", {"code": code}, json.dumps({"code": code}))
    result = await box.call(call, timeout=60)
    assert result.ok and result.content == str(__import__("math").factorial(30))
    bad = ParsedCall("call_1", "python", {"code": "1/0"}, "{}")
    text = (await box.call(bad, timeout=60)).content
    assert "ZeroDivisionError" in text and text.endswith("[exit status 1]")
    silent = await box.call(ParsedCall("call_2", "python", {"code": "x = 1"}, "{}"), timeout=60)
    assert silent.content == "(no output)"
    quick = python_tool(ALL.model_copy(update={"wall_seconds": 1.0}))
    assert "1 s of wall-clock time" in (quick.__doc__ or "")
    assert await quick("import time\ntime.sleep(60)") == "[killed: took longer than 1 s]"


def test_results_are_plain_data() -> None:
    result = SandboxResult("a", "b", 0, None, ("rlimits",))
    assert result.layers == ("rlimits",) and result.exit_code == 0
