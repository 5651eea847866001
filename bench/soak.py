"""The soak: a long `grpo-mesh demo` (two rollouts, the tiny model, its own run directory) under random
faults, then a verdict on what a run that survives hung and dead peers must show.

While the demo trains, one fault at a time hits one of its five services (env, learner, scheduler,
rollout-0, rollout-1), drawn from `--seed` (bench/soak_plan.py: a shuffled round robin over the
services, so every one is hit; the first round freezes each of them, later faults are a kill with
probability `--kill-fraction`; a gap drawn from `--interval` seconds separates one fault's end from the
next one's start):

  freeze   SIGSTOP of the service's whole process tree (vLLM's engine processes included) for a
           duration drawn from `--freeze`, then SIGCONT: a peer that hangs without dying
  kill     SIGKILL of the service's process group (`kill -9 -PGID`); the launcher's supervisor restarts it

Services are found among the launcher's own children by the port file in their command line (never
by process name; bench/soak_procs.py). The demo runs `--steps` steps (default: enough for `--duration`
seconds, or for the schedule if it is longer, at `--steps-per-s`), with evaluation off so that a
stall is a fault's. Afterwards each check prints PASS or FAIL:

  faults injected      every planned fault was injected (training may not end before the schedule does)
  launcher exit 0      the demo finished by itself, within `--limit`
  all steps done       a step row for every version up to --steps
  versions +1 per step each step row one version past the previous along the surviving lineage (a
                       `learner_rewind` row restarts the count; docs/recovery.md)
  alignment            `logprob_abs_diff_max` ≤ `--alignment-max` on every measured step row (null: skipped)
  audit                `grpo-mesh audit RUN_DIR` exits 0 with --steps steps
  no process left      every process seen in the run's trees has exited `--grace` s after the launcher
  no /dev/shm left     no /dev/shm segment that was not there before the run and that a process of the
                       run mapped or held open is left (a new segment no process of the run was seen
                       with is listed but not counted: the machine may run other programs)
  stalls within bounds a frozen env, learner or scheduler stalls training ≤ freeze + `--slack` s, a
                       frozen rollout ≤ `--slack` s; kills are reported only. A stall is the longest
                       gap between completed steps over the fault, minus the median step interval of
                       the 20 steps before it (bench/soak_checks.py)

and a table of the faults: when (s after the first step), which service, which kind, how long it was
frozen, the training stall it caused and the verdict. The table, the checks and the plan are written
to RUN_DIR/soak.json. Exit 1 on any FAIL; leftovers of the run are killed (by pid) before exiting.

    make soak                                                        # 10 minutes, 8 faults, seed 0
    make soak SOAK_ARGS="--duration 200 --faults 5 --interval 10 20 --freeze 20 30 --seed 3"
    .venv/bin/python bench/soak.py --duration 180 --faults 8 --kill-fraction 1 --interval 8 15 \
        --freeze 15 20 --seed 3 --steps-per-s 2 --run-dir runs/soak-short       # ~8 min: kills too

`--steps-per-s` should be about the demo's pace on the machine (the soak prints the measured pace
before the first fault): set too low, training ends before the last faults; too high, the run goes on
long after them (a loaded 2-core machine trains 0.5–2 steps/s).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import itertools

from soak_checks import (
    Check,
    check_alignment,
    check_audit,
    check_stalls,
    check_steps_done,
    check_versions,
    judge_faults,
    read_rows,
    step_times,
    table,
)
from soak_plan import PlannedFault, auto_steps, horizon, plan_faults, run_services
from soak_procs import (
    TreeWatch,
    describe,
    find_service,
    freeze,
    kill_all,
    kill_group,
    shm_segments,
    thaw,
)

REPO = Path(__file__).resolve().parents[1]
TICK_S = 0.25
SHM_EVERY = 4  # ticks between scans of the run's /dev/shm mappings
FIND_TIMEOUT_S = 180.0  # how long a fault waits for its service to be back (a restart of vLLM: ~35 s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/soak.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--duration", type=float, default=600.0, help="Seconds of training under faults (at least)."
    )
    parser.add_argument(
        "--faults", type=int, default=8, help="Faults to inject (≥ the services: all are hit)."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the fault schedule.")
    parser.add_argument(
        "--interval", type=float, nargs=2, default=[20.0, 40.0], metavar=("MIN", "MAX"),
        help="Seconds from one fault's end to the next one's start, drawn uniformly.",
    )  # fmt: skip
    parser.add_argument(
        "--freeze", type=float, nargs=2, default=[30.0, 60.0], metavar=("MIN", "MAX"),
        help="Seconds a service stays frozen (SIGSTOP → SIGCONT), drawn uniformly.",
    )  # fmt: skip
    parser.add_argument(
        "--kill-fraction", type=float, default=0.5,
        help="After every service was frozen once, the probability that a fault is a kill -9.",
    )  # fmt: skip
    parser.add_argument("--tail", type=float, default=30.0, help="Seconds of training after the last fault.")
    parser.add_argument("--rollouts", type=int, default=2, help="Rollout processes of the demo.")
    parser.add_argument("--steps", type=int, default=0, help="Demo steps; 0 = enough for the schedule.")
    parser.add_argument(
        "--steps-per-s", type=float, default=3.0,
        help="Training rate assumed for --steps 0 (too high only makes the run longer; too low ends "
        "training before the last faults, which fails `faults injected`).",
    )  # fmt: skip
    parser.add_argument("--model", default="", help="Demo --model; empty: the tiny model.")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/soak"), help="The demo's run directory.")
    parser.add_argument(
        "--demo-args", default="", help='More demo flags, one string: --demo-args="--secure --seed 1".'
    )
    parser.add_argument(
        "--slack", type=float, default=5.0, help="Seconds a freeze's stall may exceed its bound."
    )
    parser.add_argument(
        "--alignment-max", type=float, default=1e-4, help="Largest logprob_abs_diff_max allowed."
    )
    parser.add_argument("--grace", type=float, default=20.0, help="Seconds for the run's processes to exit.")
    parser.add_argument(
        "--limit", type=float, default=0.0,
        help="Seconds before the soak stops a demo that has not finished; 0 = 3 × horizon + 15 min.",
    )  # fmt: skip
    args = parser.parse_args(argv)
    for name in ("interval", "freeze"):
        low, high = getattr(args, name)
        if not 0 <= low <= high:
            parser.error(f"--{name}: need 0 <= MIN <= MAX, got {low:g} {high:g}")
    if not 0 <= args.kill_fraction <= 1:
        parser.error("--kill-fraction: must be within [0, 1]")
    if args.faults < 1 or args.rollouts < 1 or args.duration <= 0 or args.steps < 0 or args.steps_per_s <= 0:
        parser.error("--faults and --rollouts must be ≥ 1, --duration and --steps-per-s > 0, --steps ≥ 0")
    try:
        args.demo_args = shlex.split(args.demo_args)
    except ValueError as exc:
        parser.error(f"--demo-args: {exc}")
    args.run_dir = args.run_dir.resolve()
    return args


def make_plan(args: argparse.Namespace) -> tuple[list[PlannedFault], int]:
    """The fault schedule and the demo's step count for these arguments."""
    plan = plan_faults(
        run_services(args.rollouts), args.faults, args.seed, tuple(args.interval), tuple(args.freeze),
        args.kill_fraction,
    )  # fmt: skip
    steps = args.steps or auto_steps(plan, args.duration, args.tail, args.steps_per_s)
    return plan, steps


def demo_command(args: argparse.Namespace, steps: int) -> list[str]:
    command = [sys.executable, "-m", "services", "demo"]  # = grpo-mesh demo (services/cli.py)
    command += ["--steps", str(steps), "--run-dir", str(args.run_dir), "--rollouts", str(args.rollouts)]
    command += ["--eval-every", "0"] + (["--model", args.model] if args.model else [])
    return command + args.demo_args


@dataclass
class Frozen:
    fault: dict[str, Any]
    processes: list[psutil.Process]
    thaw_at: float


@dataclass
class Soak:
    """One soak run: the launcher, the faults as injected, what the run's trees held."""

    args: argparse.Namespace
    plan: list[PlannedFault]
    steps: int
    faults: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    first_step: float | None = None
    limit_hit: bool = False
    started: float = 0.0
    watch: TreeWatch | None = None
    interrupted: bool = False
    frozen: Frozen | None = None  # the fault in progress, if it is a freeze
    pending: list[PlannedFault] = field(default_factory=list)  # planned, not injected yet

    def run(self) -> tuple[int, TreeWatch, float]:
        """Run the demo with the faults; returns the launcher's exit code, the watch and the end time."""
        args = self.args
        args.run_dir.mkdir(parents=True, exist_ok=True)
        (args.run_dir / "soak.json").unlink(missing_ok=True)
        log = (args.run_dir / "soak-launcher.log").open("w")
        limit = args.limit or 3 * horizon(self.plan, args.duration, args.tail) + 900
        self.started = started = time.time()
        launcher = subprocess.Popen(
            demo_command(args, self.steps), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        self.watch = watch = TreeWatch(psutil.Process(launcher.pid))
        self.pending = list(self.plan)
        try:
            self._loop(launcher, watch, started + limit)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: stop the demo, then check what it did
            self.interrupted = True
            say("interrupted: stopping the demo")
        finally:
            self._thaw()  # the run ended (or the soak was stopped) during a freeze
            if launcher.poll() is None:
                self._stop(launcher)
            log.close()
        reason = "the soak was interrupted" if self.interrupted else "the run ended first"
        self.skipped += [f"{f.service} {f.kind}: {reason}" for f in self.pending]
        return launcher.returncode, watch, time.time()

    def _loop(self, launcher: subprocess.Popen, watch: TreeWatch, deadline: float) -> None:
        pending, shift, waiting_since, tick = self.pending, 0.0, None, 0
        while launcher.poll() is None:
            now = time.time()
            watch.sample(shm=tick % SHM_EVERY == 0)
            tick += 1
            if now > deadline:
                self.limit_hit = True
                say(f"limit reached ({self.args.limit or 'auto'}): stopping the demo")
                return
            if self.first_step is None:
                rows = read_rows(self.args.run_dir / "metrics.jsonl")
                times = [t for t in step_times(rows) if t >= self.started]  # not a --resume'd run's
                if times:
                    self.first_step = times[0]
                    say(f"first step done; {len(self.plan)} faults planned over {self.plan[-1].end:.0f} s")
            elif self.frozen is not None:
                if now >= self.frozen.thaw_at and (thawed := self._thaw()):
                    shift = max(shift, thawed["end"] - (self.first_step + thawed["planned_end"]))
            elif pending and now >= self.first_step + pending[0].at + shift:
                fault = pending[0]
                victim = find_service(watch.root, self.args.run_dir, fault.service)
                if victim is None:  # being restarted: wait for it, within reason
                    waiting_since = waiting_since or now
                    if now - waiting_since > FIND_TIMEOUT_S:
                        self.skipped.append(
                            f"{fault.service} {fault.kind}: not found for {FIND_TIMEOUT_S:g} s"
                        )
                        pending.pop(0)
                        waiting_since = None
                else:
                    if not self.faults:
                        self._project(now)
                    pending.pop(0)
                    waiting_since = None
                    self.frozen = self._inject(fault, victim, now)
                    if self.frozen is None:
                        shift = max(shift, now - (self.first_step + fault.end))
            time.sleep(TICK_S)

    def _thaw(self) -> dict[str, Any] | None:
        """SIGCONT the frozen service's tree, if one is frozen; returns its fault, with its length."""
        frozen, self.frozen = self.frozen, None
        if frozen is None:
            return None
        thaw(frozen.processes)
        fault = frozen.fault
        fault["end"] = time.time()
        fault["freeze_s"] = round(fault["end"] - fault["start"], 2)
        say(f"thawed {fault['service']} after {fault['freeze_s']:.1f} s")
        return fault

    def _project(self, now: float) -> None:
        """Before the first fault: the fault-free step rate so far, and what it means for the run (a
        rate far from --steps-per-s makes the run end before the schedule does, or long after)."""
        done = len(step_times(read_rows(self.args.run_dir / "metrics.jsonl")))
        elapsed = now - (self.first_step or now)
        if done < 2 or elapsed <= 0:
            return
        rate = (done - 1) / elapsed
        needed = self.steps / rate
        end = self.plan[-1].end + self.args.tail
        say(
            f"{rate:.2f} steps/s before the first fault: {self.steps} steps take ~{needed:.0f} s plus the "
            f"stalls; the schedule needs {end:.0f} s"
            + ("" if needed >= end else " (training may end first: raise --steps or --steps-per-s)")
        )

    def _inject(self, fault: PlannedFault, victim: psutil.Process, now: float) -> Frozen | None:
        record: dict[str, Any] = {
            "service": fault.service, "kind": fault.kind, "planned_at": fault.at, "planned_end": fault.end,
            "start": now, "end": now, "freeze_s": 0.0, "pid": victim.pid,
        }  # fmt: skip
        self.faults.append(record)
        t = now - (self.first_step or now)
        if fault.kind == "kill":
            victims = kill_group(victim)
            record["pids"] = [p.pid for p in victims]
            say(f"t={t:.0f}s kill -9 {fault.service} (group {victim.pid}: {len(victims)} processes)")
            return None
        stopped = freeze(victim)
        record["pids"] = [p.pid for p in stopped]
        say(f"t={t:.0f}s SIGSTOP {fault.service} ({len(stopped)} processes) for {fault.freeze_s:.1f} s")
        return Frozen(record, stopped, now + fault.freeze_s)

    @staticmethod
    def _stop(launcher: subprocess.Popen) -> None:
        """SIGTERM the launcher (it stops every service), SIGKILL its group if it does not exit."""
        launcher.terminate()
        try:
            launcher.wait(timeout=90)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM to the soak: as Ctrl-C (thaw, stop the demo, check what it did, kill its leftovers)."""
    raise KeyboardInterrupt


def say(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


def audit(run_dir: Path, steps: int) -> Check:
    try:
        done = subprocess.run(
            [sys.executable, "-m", "services", "audit", str(run_dir)],  # = grpo-mesh audit
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return Check("audit", False, "did not finish within 300 s")
    print(done.stdout.rstrip(), file=sys.stderr)
    return check_audit(done.returncode, done.stdout + done.stderr, steps)


def verdict(soak: Soak, rc: int, watch: TreeWatch, run_end: float, shm_before: set[str]) -> dict[str, Any]:
    """Every check, the faults table and what was left, as soak.json holds them."""
    args = soak.args
    leftovers = watch.leftovers(args.grace)
    new_shm = sorted(shm_segments() - shm_before)
    ours = [name for name in new_shm if name in watch.shm]
    others = [name for name in new_shm if name not in watch.shm]
    left_lines = [describe(p) for p in leftovers]
    kill_all(leftovers)  # ours, by pid: nothing of the soak outlives it
    rows = read_rows(args.run_dir / "metrics.jsonl")
    times = step_times(rows)
    judged = judge_faults(soak.faults, times, run_end, args.slack)
    injected = len(soak.faults)
    checks = [
        Check("faults injected", not soak.skipped, f"{injected} of {len(soak.plan)}"
              + ("; not injected: " + "; ".join(soak.skipped) if soak.skipped else "")),
        Check("launcher exit 0", rc == 0 and not soak.limit_hit and not soak.interrupted,
              f"exit {rc}" + (" (stopped at --limit)" if soak.limit_hit else "")
              + (" (the soak was interrupted)" if soak.interrupted else "")),
        check_steps_done(rows, soak.steps),
        check_versions(rows, soak.steps),
        check_alignment(rows, args.alignment_max),
        audit(args.run_dir, soak.steps),
        Check("no process left", not leftovers, f"{len(watch.seen)} seen, {len(leftovers)} left"
              + "".join(f"\n        {line}" for line in left_lines)),
        Check("no /dev/shm left", not ours, f"{len(ours)} of the run's left: {ours}" + (
              f"; new but never seen in the run's processes (not counted): {others}" if others else "")),
        check_stalls(judged),
    ]  # fmt: skip
    intervals = [b - a for a, b in itertools.pairwise(times)]
    return {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "steps": soak.steps,
        "plan": [f.as_dict() for f in soak.plan],
        "first_step_time": soak.first_step,
        "run_end_time": run_end,
        "median_step_interval_s": statistics.median(intervals) if intervals else None,
        "faults": judged,
        "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks],
        "leftover_processes": left_lines,
        "leftover_shm": {"run": ours, "unattributed": others},
        "shm_seen": sorted(watch.shm),
        "ok": all(c.ok for c in checks),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan, steps = make_plan(args)
    say(
        f"demo: {steps} steps, {args.rollouts} rollouts, run dir {args.run_dir}; "
        "plan (s after the first step):"
    )
    for fault in plan:
        print(f"    {fault.at:7.1f}  {fault.service:<10} {fault.kind:<6} {fault.freeze_s:5.1f}", flush=True)
    shm_before = shm_segments()
    soak = Soak(args, plan, steps)
    signal.signal(signal.SIGTERM, interrupt)
    rc, watch, run_end = soak.run()
    say(f"launcher exited with {rc}; checking the run")
    result = verdict(soak, rc, watch, run_end, shm_before)
    print()
    print(table(result["faults"], soak.first_step or run_end))
    print(f"the run's median step interval: {result['median_step_interval_s'] or 0:.2f} s")
    print()
    for check in result["checks"]:
        print(Check(**check).line())
    (args.run_dir / "soak.json").write_text(json.dumps(result, indent=2))
    print(f"\nsoak: {'PASS' if result['ok'] else 'FAIL'} (details in {args.run_dir / 'soak.json'})")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
