"""The terminal status view: `render` on hand-built GetStatus answers (pure), and the CLI against a
real scheduler.

The live tests serve the real `SchedulerApp` (real gRPC server, `SchedulerServicer`, `Orchestrator`,
ledger) on 127.0.0.1:0 with the in-memory peers of fakes.py in place of the env, learner and
rollouts, so a whole 3-step run takes milliseconds; the CLI runs as a subprocess
(`python -m services status`, i.e. `grpo-mesh status`). The same view over real model services is checked in
tests/e2e/test_scheduler_services.py.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import tomli_w
from rich.console import Console

from grpo.scheduler.v1 import scheduler_pb2
from services.common.serve import RunningServer, start_server
from services.launch.certs import issue
from services.scheduler.config import SchedulerSettings
from services.scheduler.server import SchedulerApp
from services.scheduler.status_view import (
    ADDRESS_ENV,
    DEFAULT_ADDRESS,
    progress,
    render,
    resolve_address,
    rollout_style,
    unreachable,
)
from tests.scheduler.fakes import FakeRollout, cluster

REPO = Path(__file__).resolve().parents[3]


# ---- render (pure) -------------------------------------------------------------------------------


def _text(renderable) -> str:
    console = Console(record=True, width=140, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _status(**overrides) -> scheduler_pb2.GetStatusResponse:
    status = scheduler_pb2.GetStatusResponse(
        learner_version=12, step=12, max_steps=40, reward_mean=0.4375, loss=-0.0123, steps_per_second=3.5,
        tokens_per_second=812, staleness_mean=0.62, logprob_abs_diff_max=2.4e-6,
        weight_transport="grpc_stream", uptime_seconds=3725,
        last_sync=scheduler_pb2.SyncPhases(prepare_ms=1.5, stage_ms=20.25, commit_ms=8.0, total_ms=29.75),
        rollouts=[
            scheduler_pb2.RolloutLoad(rollout_id="rollout-0", address="127.0.0.1:7001", weight_version=12,
                                      in_flight=3, max_in_flight=16, healthy=True),
        ],
    )  # fmt: skip
    status.queue_depths.update({"prompts": 64, "scored": 2})
    status.groups_by_state.update({"issued": 5, "trained": 192})
    for key, value in overrides.items():
        if key == "rollouts":
            status.rollouts.extend(value)
        elif key == "last_sync":
            status.last_sync.CopyFrom(value)
        else:
            setattr(status, key, value)
    return status


def _rollout(rollout_id: str, version: int, healthy: bool = True) -> scheduler_pb2.RolloutLoad:
    return scheduler_pb2.RolloutLoad(
        rollout_id=rollout_id, address="10.0.0.9:7009", weight_version=version, in_flight=0,
        max_in_flight=8, healthy=healthy,
    )  # fmt: skip


def test_a_healthy_run_shows_progress_rates_sync_queues_and_rollouts() -> None:
    text = _text(render(_status(), "127.0.0.1:50050"))
    for needle in (
        "grpo-mesh run @ 127.0.0.1:50050", "training", "12/40 (30%)", "learner version", "3.50", "812",
        "0.4375", "-0.01230", "0.62", "2.40e-06", "1h02m05s",
        "29.8 ms (prepare 1.5 · stage 20.2 · commit 8.0) via grpc_stream",
        "queue prompts", "64", "queue scored", "groups issued", "groups trained", "192",
        "rollouts (1; 0 behind, 0 unhealthy)", "rollout-0", "127.0.0.1:7001", "3/16", "✓",
    ):  # fmt: skip
        assert needle in text, needle
    assert "error" not in text and "✗" not in text


def test_paused_finished_and_failed_runs_say_so() -> None:
    assert "paused" in _text(render(_status(paused=True), "a:1"))
    assert "finished" in _text(render(_status(finished=True, step=40), "a:1"))
    failed = _text(render(_status(finished=True, error="AlignmentError: logprobs differ by 0.3"), "a:1"))
    assert "failed" in failed and "finished" not in failed
    assert "AlignmentError: logprobs differ by 0.3" in failed
    # the state is coloured: red for a failure, yellow for paused
    console = Console(
        record=True, width=140, file=io.StringIO(), force_terminal=True, color_system="standard"
    )
    console.print(render(_status(error="boom"), "a:1"))
    assert "\x1b[1;31mfailed" in console.export_text(styles=True)


def test_a_rollout_behind_the_learner_and_an_unhealthy_one_stand_out() -> None:
    status = _status(rollouts=[_rollout("rollout-late", 10), _rollout("rollout-down", 12, healthy=False)])
    text = _text(render(status, "a:1"))
    assert "rollouts (3; 1 behind, 1 unhealthy)" in text
    late = next(line for line in text.splitlines() if "rollout-late" in line)
    down = next(line for line in text.splitlines() if "rollout-down" in line)
    assert "10 (-2)" in late and "✓" in late
    assert "✗" in down and "0/8" in down
    assert [rollout_style(r, 12) for r in status.rollouts] == ["", "yellow", "red"]


def test_no_measured_probe_reads_not_measured() -> None:
    status = _status()
    status.ClearField("logprob_abs_diff_max")  # none yet, or the last one skipped
    assert "not measured" in _text(render(status, "a:1"))


def test_no_max_steps_and_no_sync_yet() -> None:
    text = _text(render(_status(max_steps=0, last_sync=scheduler_pb2.SyncPhases()), "a:1"))
    assert "12 (until stopped)" in text and "none yet (transport grpc_stream)" in text
    assert progress(0, 3) == "0/3 (0%)"


def test_unreachable_keeps_the_last_view_under_a_red_line() -> None:
    alone = _text(unreachable("a:1", "UNAVAILABLE", None))
    assert "scheduler a:1 unreachable: UNAVAILABLE (retrying)" in alone
    text = _text(unreachable("a:1", "UNAVAILABLE", _status()))
    assert "unreachable" in text and "12/40 (30%)" in text


def test_the_address_comes_from_the_flag_the_run_dir_the_env_or_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ADDRESS_ENV, raising=False)
    assert resolve_address("", None) == DEFAULT_ADDRESS
    monkeypatch.setenv(ADDRESS_ENV, "10.1.2.3:4")
    assert resolve_address("", None) == "10.1.2.3:4"
    assert resolve_address("h:5", None) == "h:5"
    with pytest.raises(FileNotFoundError, match=r"scheduler\.port"):
        resolve_address("", tmp_path)
    (tmp_path / "scheduler.port").write_text("50123\n")
    assert resolve_address("", tmp_path) == "127.0.0.1:50123"


# ---- the CLI against a real scheduler --------------------------------------------------------------


async def _serve(run_dir: Path, port: int = 0, security: dict | None = None) -> RunningServer:
    """The real SchedulerApp on 127.0.0.1:`port`, training 3 steps against in-memory peers."""
    fake = cluster(
        run_dir, FakeRollout("127.0.0.1:7001", rollout_id="rollout-a"),
        FakeRollout("127.0.0.1:7002", rollout_id="rollout-b"), max_steps=3,
    )  # fmt: skip
    settings = SchedulerSettings(
        host="127.0.0.1", port=port, rollout_addresses=[], run_dir=run_dir / "unused",
        **({"security": security} if security else {}),
    )  # fmt: skip
    app = SchedulerApp(settings)
    app.env, app.learner, app.pool = fake.env, fake.learner, fake.orchestrator.pool
    app.orchestrator = fake.orchestrator  # before start_server: register() hands it to the servicer
    for peer in (fake.env, fake.learner, *fake.rollouts.values()):
        peer.wait_ready = _always_ready  # in-memory peers are always there
    running = await start_server(app, settings)
    await asyncio.wait_for(asyncio.shield(app.run_task), 15)  # the 3 steps, then it keeps serving
    return running


async def _always_ready(timeout: float) -> None:  # noqa: ASYNC109
    return None


@pytest.fixture
async def scheduler(tmp_path: Path) -> AsyncIterator[RunningServer]:
    running = await _serve(tmp_path / "run")
    yield running
    await running.close()


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services", "status", *args, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**_env(), **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (ADDRESS_ENV, "GRPO_TOKEN")}
    return {**env, "COLUMNS": "160"}


async def test_one_shot_shows_a_live_run_and_an_absent_scheduler_is_exit_2(scheduler: RunningServer) -> None:
    (code, out, err), (absent, _, absent_err) = await asyncio.gather(
        _cli("--address", scheduler.address), _cli("--address", "127.0.0.1:1", "--timeout", "2")
    )
    assert code == 0, err
    for needle in (
        f"grpo-mesh run @ {scheduler.address}", "finished", "3/3 (100%)", "learner version", "rollout-a",
        "rollout-b", "via shared_memory", "groups trained", "rollouts (2; 0 behind, 0 unhealthy)",
    ):  # fmt: skip
        assert needle in out, (needle, out)
    assert absent == 2
    lines = absent_err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("status: the scheduler at 127.0.0.1:1 is unreachable: ")


async def test_run_dir_finds_the_port_and_dials_with_the_runs_tls_and_token(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    creds = issue(run_dir / "tls")
    security = creds.security_table(mutual=True)
    running = await _serve(run_dir, security=security)
    try:
        (run_dir / "scheduler.port").write_text(str(running.port))
        (run_dir / "run.toml").write_text(tomli_w.dumps({"security": security}))
        (code, out, err), (plain, _, plain_err) = await asyncio.gather(
            _cli("--run-dir", str(run_dir)), _cli("--address", running.address, "--timeout", "3")
        )
        assert code == 0, err
        assert "3/3 (100%)" in out and "rollout-a" in out
        assert plain == 2 and plain_err.startswith(f"status: the scheduler at {running.address}")
    finally:
        await running.close()


async def test_watch_keeps_asking_until_the_scheduler_comes_and_the_run_finishes(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    watch = asyncio.create_task(
        _cli("--address", f"127.0.0.1:{port}", "--until-finished", "--interval", "0.2", "--timeout", "1")
    )
    await asyncio.sleep(2.0)  # the watcher finds nobody for a while
    assert not watch.done()
    running = await _serve(tmp_path / "run", port=port)
    try:
        code, out, err = await asyncio.wait_for(watch, 60)
        assert code == 0, err
        assert "3/3 (100%)" in out and "finished" in out and "rollout-b" in out
    finally:
        await running.close()


async def test_watch_shows_unreachable_and_ctrl_c_exits_0() -> None:
    # a terminal-like stdout (TTY_COMPATIBLE) so each refresh is written at once; SIGINT restored in
    # the child, since a shell's background job (the test run) may have it ignored
    child = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = ['x', 'status', '--address', '127.0.0.1:1', '--watch', '--interval', '0.2']; "
        "runpy.run_module('services', run_name='__main__')"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", child, cwd=REPO, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env={**_env(), "TTY_COMPATIBLE": "1"},
    )  # fmt: skip
    assert process.stdout is not None
    seen = b""
    while b"unreachable" not in seen:
        chunk = await asyncio.wait_for(process.stdout.read(4096), 30)
        assert chunk, seen
        seen += chunk
    process.send_signal(signal.SIGINT)
    _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    assert b"scheduler 127.0.0.1:1 unreachable" in seen and b"(retrying)" in seen


def test_a_run_with_difficulty_levels_shows_each_level_success_rate() -> None:
    assert "level success" not in _text(render(_status(), "a:1"))
    status = _status()
    status.level_success.update({"1": 0.75, "2": 0.125})
    text = _text(render(status, "a:1"))
    assert "level success" in text and "1: 0.75  2: 0.12" in text, text
