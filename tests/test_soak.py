"""The soak harness (bench/soak.py), without the soak itself: its command line, its fault schedule,
its checks on a recorded run, and its process handling on real processes and real signals (a parent
with a child, frozen, thawed and killed as a service's tree would be)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import soak  # noqa: E402
from soak_checks import (  # noqa: E402
    check_alignment,
    check_audit,
    check_stalls,
    check_steps_done,
    check_versions,
    judge_faults,
    longest_gap,
    read_rows,
    step_times,
    table,
)
from soak_plan import auto_steps, plan_faults, run_services  # noqa: E402
from soak_procs import find_service, freeze, kill_group, service_tag, shm_in_use, thaw  # noqa: E402

FIVE = ["env", "learner", "scheduler", "rollout-0", "rollout-1"]

# ---- command line -------------------------------------------------------------------------------------


def test_the_defaults_are_a_ten_minute_soak_with_eight_faults_on_two_rollouts() -> None:
    args = soak.parse_args([])
    assert args.duration >= 600 and args.faults >= 8 and args.rollouts == 2
    assert args.freeze == [30.0, 60.0]  # the freezes
    plan, steps = soak.make_plan(args)
    assert len(plan) == args.faults and steps >= args.duration * args.steps_per_s
    command = soak.demo_command(args, steps)
    assert command[1:4] == ["-m", "services", "demo"]
    assert command[command.index("--rollouts") + 1] == "2" and command[command.index("--steps") + 1] == str(
        steps
    )
    assert command[command.index("--eval-every") + 1] == "0"  # an evaluation would read as a stall
    assert Path(command[command.index("--run-dir") + 1]).is_absolute()  # service_tag compares paths


def test_flags_parse_and_a_bad_range_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    args = soak.parse_args(
        ["--duration", "200", "--faults", "5", "--interval", "5", "10", "--freeze", "20", "30", "--seed", "3",
         "--demo-args=--secure --seed 1", "--run-dir", "runs/x"]
    )  # fmt: skip
    assert (args.duration, args.faults, args.seed) == (200.0, 5, 3)
    assert args.interval == [5.0, 10.0] and args.freeze == [20.0, 30.0]
    assert args.demo_args == ["--secure", "--seed", "1"] and soak.demo_command(args, 9)[-3:] == args.demo_args
    for bad in (["--freeze", "60", "30"], ["--kill-fraction", "2"], ["--faults", "0"], ["--demo-args", "'"]):
        with pytest.raises(SystemExit) as exit_:
            soak.parse_args(bad)
        assert exit_.value.code == 2, bad
    assert "--freeze: need 0 <= MIN <= MAX" in capsys.readouterr().err


# ---- the fault schedule --------------------------------------------------------------------------------


@pytest.mark.parametrize("faults", [5, 6, 8, 11])
def test_every_service_is_frozen_and_faults_never_overlap(faults: int) -> None:
    for seed in range(20):
        plan = plan_faults(FIVE, faults, seed, (20.0, 40.0), (30.0, 60.0), kill_fraction=0.5)
        assert len(plan) == faults
        assert {f.service for f in plan if f.kind == "freeze"} == set(FIVE)  # each one frozen at least once
        for start in range(0, faults, len(FIVE)):  # a round robin: no service twice in a round
            round_ = plan[start : start + len(FIVE)]
            assert len({f.service for f in round_}) == len(round_)
        for f in plan:
            assert (30.0 <= f.freeze_s <= 60.0) if f.kind == "freeze" else f.freeze_s == 0.0
        previous_end = 0.0
        for f in plan:
            assert 20.0 <= f.at - previous_end <= 40.0 + 0.1  # a gap after the previous fault's end
            previous_end = f.end


def test_the_schedule_is_seeded_and_later_rounds_mix_kills_in() -> None:
    args = dict(services=FIVE, faults=20, interval=(1.0, 2.0), freeze=(3.0, 4.0), kill_fraction=0.5)
    assert plan_faults(seed=7, **args) == plan_faults(seed=7, **args)
    assert plan_faults(seed=7, **args) != plan_faults(seed=8, **args)
    kinds = [f.kind for f in plan_faults(seed=7, **args)]
    assert kinds[:5] == ["freeze"] * 5 and "kill" in kinds[5:] and "freeze" in kinds[5:]
    assert {f.kind for f in plan_faults(seed=7, **{**args, "kill_fraction": 1.0})[5:]} == {"kill"}
    with pytest.raises(ValueError, match="freeze"):
        plan_faults(FIVE, 5, 0, (1.0, 2.0), (5.0, 4.0), 0.5)


def test_steps_cover_the_duration_or_the_schedule_if_it_is_longer() -> None:
    assert run_services(2) == FIVE
    plan = plan_faults(FIVE, 8, 0, (20.0, 40.0), (30.0, 60.0), 0.5)
    assert auto_steps(plan, duration=10_000, tail=30, steps_per_s=2) == 20_000
    assert auto_steps(plan, duration=10, tail=30, steps_per_s=2) == int((plan[-1].end + 30) * 2 + 0.999)


# ---- checks on a recorded run ---------------------------------------------------------------------------


def step(n: int, t: float, version: int | None = None, diff: float | None = 1e-6, **extra: object) -> dict:
    return {"step": n, "weight_version": n if version is None else version, "reward_mean": 0.5, "time": t,
            "logprob_abs_diff_max": diff, **extra}  # fmt: skip


def test_versions_follow_the_surviving_lineage_across_a_rewind() -> None:
    rows = [{"eval_only": True, "step": 0, "weight_version": 0, "reward_mean": 0.1, "time": 0.0}]
    rows += [step(n, float(n)) for n in range(1, 6)]
    rows.append({"event": "learner_rewind", "step": 3, "weight_version": 3, "time": 6.0})
    rows += [step(n, 6.0 + n, retrained=True) for n in (4, 5)] + [step(6, 13.0)]
    rows.append({"step": 7, "weight_version": 7, "recovered": True, "reward_mean": 0.4, "time": 14.0})
    assert check_versions(rows, 7).ok, check_versions(rows, 7)
    assert check_steps_done(rows, 7).ok and not check_steps_done(rows, 8).ok
    assert not check_versions(rows, 8).ok  # the lineage ends short of the steps asked for
    skipped = [r for r in rows if r.get("step") != 6]
    result = check_versions(skipped, 7)
    assert not result.ok and "expected 6" in result.detail
    assert check_alignment(rows, 1e-4).ok  # the recovered row has no figure and is not counted
    assert not check_alignment([*rows, step(8, 15.0, diff=2e-4)], 1e-4).ok
    skipped = check_alignment([*rows, step(8, 15.0, diff=None)], 1e-4)  # no rollout answered the probe
    assert skipped.ok and "1 skipped" in skipped.detail
    assert not check_alignment([step(8, 15.0, diff=None)], 1e-4).ok  # nothing measured at all
    assert not check_alignment([], 1e-4).ok


def test_a_stall_is_the_longest_gap_over_the_fault_window_minus_the_median_interval() -> None:
    times = [float(t) for t in range(0, 11)] + [46.0, 47.0, 48.0]  # a 1 s step; nothing from 10 to 46
    assert longest_gap(times, 15.0, 40.0, run_end=50.0) == 36.0
    assert longest_gap(times, 3.0, 3.0, run_end=50.0) == 1.0
    assert longest_gap(times[:11], 15.0, 40.0, run_end=50.0) == 40.0  # never trained again: to the end
    faults = [
        {"service": "scheduler", "kind": "freeze", "start": 12.0, "end": 42.0, "freeze_s": 30.0},
        {"service": "rollout-0", "kind": "freeze", "start": 12.0, "end": 42.0, "freeze_s": 30.0},
        {"service": "learner", "kind": "freeze", "start": 12.0, "end": 42.0, "freeze_s": 29.0},
        {"service": "env", "kind": "kill", "start": 20.0, "end": 20.0, "freeze_s": 0.0},
    ]
    judged = judge_faults(faults, times, run_end=50.0, slack=5.0)
    assert [f["stall_s"] for f in judged] == [35.0] * 4
    assert [f["verdict"] for f in judged] == ["ok", "FAIL", "FAIL", "report"]
    assert [f["bound_s"] for f in judged] == [35.0, 5.0, 34.0, None]
    result = check_stalls(judged)
    assert not result.ok and "1 of 3 freezes" in result.detail
    assert check_stalls(judged[:1] + judged[3:]).ok
    assert "scheduler  freeze       30.0     1.00      35.0      35.0  ok" in table(judged, first_step=0.0)


def test_a_stall_is_measured_against_the_pace_just_before_the_fault() -> None:
    # a loaded machine steps every 3 s, then frees up and steps every 0.5 s: the run's median is 0.5 s
    times = [3.0 * i for i in range(30)] + [87.0 + 0.5 * i for i in range(1, 200)]
    fault = {"service": "rollout-0", "kind": "freeze", "start": 40.0, "end": 60.0, "freeze_s": 20.0}
    (judged,) = judge_faults([fault], times, run_end=200.0, slack=5.0)
    assert judged["baseline_s"] == 3.0 and judged["stall_s"] == 0.0 and judged["verdict"] == "ok"


def test_metrics_rows_are_read_as_the_scheduler_writes_them(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_rows(path) == []
    path.write_text('{"step": 1, "weight_version": 1, "reward_mean": 0.5, "time": 2.0}\n{"event": "x", "ti')
    assert step_times(read_rows(path)) == [2.0]  # the half-written line is skipped


def test_the_audit_passes_only_with_exit_0_and_every_step() -> None:
    out = "ledger runs/x/ledger.sqlite (run abc)\n  steps                20\n  batches              20\n"
    ok = out + "audit: OK (one batch per step; no group or prompt twice or skipped; staleness bounded)\n"
    assert check_audit(0, ok, 20).ok
    assert not check_audit(0, ok, 21).ok
    bad = out + "audit: 1 violation(s)\n  - step 3 trained twice\n"
    result = check_audit(1, bad, 20)
    assert not result.ok and "audit: 1 violation(s)" in result.detail


# ---- processes: real ones, real signals -------------------------------------------------------------------

SLEEPER = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
)


def _wait(predicate, timeout: float = 20.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_service_is_found_by_its_port_file_frozen_thawed_and_killed_as_a_group(tmp_path: Path) -> None:
    run_dir = tmp_path.resolve()
    # as ServiceProcess.start runs a service (`python -m services.<name> ... --port-file
    # <run_dir>/<tag>.port`, in a session of its own); here the "service" is a parent with one child
    command = [sys.executable, "-c", SLEEPER, "-m", "services.rollout", "--port", "0", "--port-file",
               str(run_dir / "rollout-1.port"), "--rollout-id", "rollout-1"]  # fmt: skip
    assert service_tag(command, run_dir) == "rollout-1"
    assert service_tag(command, run_dir / "other") is None
    assert service_tag([sys.executable, "-m", "pytest"], run_dir) is None
    process = subprocess.Popen(command, start_new_session=True)
    try:
        me = psutil.Process()
        service = find_service(me, run_dir, "rollout-1")
        assert service is not None and service.pid == process.pid
        assert find_service(me, run_dir, "rollout-0") is None
        assert _wait(lambda: len(service.children()) == 1)
        child = service.children()[0]

        stopped = freeze(service)
        assert {p.pid for p in stopped} == {service.pid, child.pid}
        assert _wait(lambda: {service.status(), child.status()} == {psutil.STATUS_STOPPED})
        thaw(stopped)
        assert _wait(lambda: psutil.STATUS_STOPPED not in {service.status(), child.status()})

        victims = kill_group(service)
        assert {p.pid for p in victims} == {service.pid, child.pid}
        assert process.wait(timeout=20) == -signal.SIGKILL
        assert _wait(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def test_a_shared_memory_segment_in_use_is_attributed_to_its_process() -> None:
    from multiprocessing import shared_memory

    segment = shared_memory.SharedMemory(create=True, size=4096)
    try:
        assert segment.name.lstrip("/") in shm_in_use(os.getpid())
    finally:
        segment.close()
        segment.unlink()
    assert segment.name.lstrip("/") not in shm_in_use(os.getpid())


def test_a_kills_stall_is_the_gap_after_it() -> None:
    """The rows of steps trained before a kill are still written after it; its cost is the gap that
    follows (here 12 s: the learner's restart and rewind)."""
    times = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 13.0, 13.2, 13.4]
    kill = {"service": "learner", "kind": "kill", "start": 0.5, "end": 0.5, "freeze_s": 0.0}
    (judged,) = judge_faults([kill], times, run_end=14.0, slack=5.0)
    assert judged["verdict"] == "report" and judged["stall_s"] == 11.8
