"""CPU core sets: parsing, formatting, splitting, the `cpus` setting, and applying it to a real process."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.cpus import (
    BusyFile,
    CoreBorrower,
    format_cpu_list,
    lender_idle,
    parse_cpu_list,
    split_cores,
)
from services.learner.config import LearnerSettings
from services.rollout.config import RolloutSettings


def test_parse_lists_and_ranges() -> None:
    assert parse_cpu_list("") == frozenset()
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("0-2, 6,8-9") == {0, 1, 2, 6, 8, 9}


@pytest.mark.parametrize("spec", ["a", "3-1", "-1", "1-x", "0--2"])
def test_parse_rejects_with_the_offending_part(spec: str) -> None:
    with pytest.raises(ValueError, match="not a"):
        parse_cpu_list(spec)


@given(st.sets(st.integers(min_value=0, max_value=200), max_size=40))
def test_format_is_the_inverse_of_parse(cores: set[int]) -> None:
    assert parse_cpu_list(format_cpu_list(cores)) == cores


def test_format_compresses_runs() -> None:
    assert format_cpu_list({0, 1, 2, 6, 8, 9}) == "0-2,6,8-9"


def test_split_gives_two_disjoint_nonempty_sets() -> None:
    assert split_cores([0, 1], 0.5) == ([0], [1])
    assert split_cores([0, 1, 2, 3, 4, 5, 6, 7], 0.25) == ([0, 1], [2, 3, 4, 5, 6, 7])
    assert split_cores([0, 1, 2], 0.01) == ([0], [1, 2])
    assert split_cores([0, 1, 2], 0.99) == ([0, 1], [2])
    assert split_cores([5], 0.5) == ([5], [5])  # one core: nothing to split


def test_cpus_setting_is_validated() -> None:
    assert LearnerSettings.load(model="m", cpus="0").cpus == "0"
    with pytest.raises(ValueError, match="not a core number"):
        LearnerSettings.load(model="m", cpus="zero")


def test_apply_pins_the_process_its_children_and_torch() -> None:
    core = min(os.sched_getaffinity(0))
    code = (
        "import os, subprocess, sys, torch\n"
        "from services.common.cpus import apply_cpu_affinity\n"
        f"apply_cpu_affinity('{core}')\n"
        "child = subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],"
        " capture_output=True, text=True, check=True).stdout.strip()\n"
        "print(sorted(os.sched_getaffinity(0)), child, torch.get_num_threads(),"
        " os.environ['OMP_NUM_THREADS'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == f"[{core}] [{core}] 1 1"


def test_nice_is_validated_and_applied_to_the_service_process(tmp_path) -> None:
    with pytest.raises(ValueError):
        LearnerSettings.load(model="m", nice=20)
    code = (
        "import os\n"
        "from services.common import serve\n"
        "from services.learner.config import LearnerSettings\n"
        "serve.uvloop.run = lambda coro: (coro.close(), print(os.nice(0)))\n"
        "serve.run_service('learner', lambda: None, LearnerSettings.load(model='m', nice=7))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == str(os.nice(0) + 7)


def test_apply_refuses_cores_the_process_may_not_use() -> None:
    from services.common.cpus import apply_cpu_affinity

    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match="not available"):
        apply_cpu_affinity(str(missing))


def test_moving_the_process_threads_leaves_the_processes_it_started_where_they_are() -> None:
    """A rollout pinned with its engine moves its own threads (old and new) once the engine runs."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    first, everything = cores[0], format_cpu_list(set(cores))
    code = textwrap.dedent(f"""
        import os, subprocess, sys, threading
        from services.common.cpus import apply_cpu_affinity, move_process_threads
        apply_cpu_affinity('{first}')
        report = 'import sys, os; sys.stdin.read(); print(sorted(os.sched_getaffinity(0)))'
        engine = subprocess.Popen([sys.executable, '-c', report], stdin=-1, stdout=-1, text=True)
        ready, done, seen = threading.Event(), threading.Event(), {{}}
        def older():
            ready.set(); done.wait(); seen['older'] = sorted(os.sched_getaffinity(0))
        thread = threading.Thread(target=older); thread.start(); ready.wait()
        move_process_threads('{everything}')
        done.set(); thread.join()
        newer = threading.Thread(target=lambda: seen.update(newer=sorted(os.sched_getaffinity(0))))
        newer.start(); newer.join()
        mine = sorted(os.sched_getaffinity(0))
        print(mine, seen['older'], seen['newer'], engine.communicate('')[0].strip())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == f"{cores} {cores} {cores} [{first}]"
    with pytest.raises(ValueError, match="not a core number"):
        RolloutSettings.load(model="m", service_cpus="all")


# ---------------------------------------------------------------- lending idle cores


def test_a_busy_file_reads_idle_only_when_it_says_so(tmp_path: Path) -> None:
    path = tmp_path / "run" / "rollout-0.busy"
    assert not lender_idle(path)  # no lender yet: busy, so nothing is borrowed
    busy = BusyFile(path)
    assert lender_idle(path)
    busy.set(True)
    assert not lender_idle(path)
    busy.set(False)
    assert lender_idle(path)
    busy.set(True)
    busy.close()  # a lender that died while busy stays busy
    assert not lender_idle(path)
    path.write_bytes(b"x")
    assert not lender_idle(path)


async def test_a_lender_stays_busy_for_its_linger_after_work_and_longer_if_more_arrives(
    tmp_path: Path,
) -> None:
    busy = BusyFile(tmp_path / "r.busy", linger_s=0.05)
    with busy.working():
        with busy.working():  # nested and overlapping work counts once
            assert not lender_idle(busy.path)
        assert not lender_idle(busy.path)
    assert not lender_idle(busy.path)  # the gap before the next burst still reads busy
    await asyncio.sleep(0.03)
    with busy.working():  # more work within the linger: the pending idle is cancelled
        await asyncio.sleep(0.04)
    await asyncio.sleep(0.03)
    assert not lender_idle(busy.path)  # 0.07 s after the first work, 0.03 s after the last
    await asyncio.sleep(0.05)
    assert lender_idle(busy.path)
    with busy.working():
        pass
    busy.close()  # closing drops the pending idle: a lender that is gone stays busy
    await asyncio.sleep(0.07)
    assert not lender_idle(busy.path)


def test_off_an_event_loop_a_lender_is_idle_as_soon_as_its_work_ends(tmp_path: Path) -> None:
    busy = BusyFile(tmp_path / "r.busy", linger_s=10.0)
    with busy.working():
        assert not lender_idle(busy.path)
    assert lender_idle(busy.path)


def test_the_borrower_widens_only_its_own_thread_while_the_lender_is_idle(tmp_path: Path) -> None:
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    own, lent = frozenset(cores[1:2]), frozenset(cores[:1])
    busy = BusyFile(tmp_path / "r.busy")
    borrower = CoreBorrower(own, lent, [busy.path])
    seen: list[tuple[bool, set[int], int]] = []
    main_affinity, main_threads = os.sched_getaffinity(0), torch.get_num_threads()

    def model_thread() -> None:
        for state in (False, True, False):
            busy.set(state)
            borrowed = borrower.borrow()
            seen.append((borrowed, os.sched_getaffinity(0), torch.get_num_threads()))
        borrower.give_back()
        seen.append((False, os.sched_getaffinity(0), torch.get_num_threads()))

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    assert seen == [(True, own | lent, 2), (False, own, 1), (True, own | lent, 2), (False, own, 1)]
    assert os.sched_getaffinity(0) == main_affinity  # the caller's thread only
    assert torch.get_num_threads() == main_threads


def test_borrowing_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="go together"):
        LearnerSettings.load(model="m", cpus="1", borrow={"cpus": "0"})
    with pytest.raises(ValueError, match="needs the learner's own cpus"):
        LearnerSettings.load(model="m", borrow={"cpus": "0", "busy_files": ["/tmp/x.busy"]})
    with pytest.raises(ValueError, match="adds no core"):
        LearnerSettings.load(model="m", cpus="0-1", borrow={"cpus": "1", "busy_files": ["/tmp/x.busy"]})
    with pytest.raises(ValueError, match="borrowing needs"):
        CoreBorrower(frozenset({1}), frozenset(), [Path("x")])
