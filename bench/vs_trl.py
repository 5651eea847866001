"""grpo-mesh end to end against TRL's synchronous `GRPOTrainer` on identical work, in one run.

Both sides train the same randomly initialised Qwen2 (the demo's tokenizer, `--hidden` × `--layers`),
on the same arithmetic prompts ("3+5="; the `arithmetic` env's train stream), with the same exact-match
reward, group size G, prompts per optimizer step, completion length cap, temperature 1, fp32
(`--dtype`), AdamW at a constant LR with gradient clipping 1.0, no KL term, the `grpo` objective, one
optimizer step per batch and no checkpoints. A random model rarely emits EOS, so completions run to
the cap on both sides (the mean completion length is printed for each). TRL generates with
transformers' `generate` (`use_vllm=False`: its vLLM modes need a GPU); grpo-mesh runs its four
services as processes (`make demo`'s launcher) with vLLM rollouts (or `--engine transformers`), one
step of staleness and the chosen weight transport.

Each side runs in its own subprocess (no shared torch state), alternating sides for `--repeats`
rounds so run-order effects cancel. Printed per side: steady optimizer steps/s and completions/s (the
first `--skip` steps excluded: start-up, compilation, the first weight sync), the learner's idle
fraction (wall time of the steady window not spent in a train step; for TRL, the time spent
generating and scoring), generation time per step (TRL: its `generate` calls; grpo-mesh, with
`--trace`: the part of the window in which some group was being generated, from the timeline; it
overlaps training), the CPU each side used per optimizer step and how many cores that kept busy on
average over the window (TRL: its process; grpo-mesh: the launcher and every process under it, vLLM's
engine core included) and the ratio grpo-mesh / TRL of steps/s — above 1.0 grpo-mesh is faster.

    .venv/bin/pip install -e '.[bench]'      # TRL, for this benchmark only
    .venv/bin/python bench/vs_trl.py                                   # tiny: 128 × 2, 24 tokens
    .venv/bin/python bench/vs_trl.py --hidden 512 --layers 10 --max-tokens 128 --steps 12 --skip 3
    .venv/bin/python bench/vs_trl.py --engine transformers             # grpo-mesh with HF-generate rollouts
    .venv/bin/python bench/vs_trl.py --trace       # + grpo-mesh's timeline per round (ui.perfetto.dev)
    # on a GPU (`make gpu-check` runs this): Qwen2.5-0.5B's shape, random weights, no vLLM there
    python bench/vs_trl.py --shape qwen2.5-0.5b --device cuda --engine transformers --transport cuda_ipc \
        --max-tokens 128 --steps 10 --skip 3 --repeats 1

By default grpo-mesh runs as `make demo` does (`--cpus split`: the rollout gets half the cores and the
learner the other half, so vLLM's core-bound OpenMP threads and torch's pool never share a core);
`--cpus shared` lets every service use every core, to measure what the split buys. Under the split the
learner borrows the rollout's cores while the rollout has nothing in flight; `--no-lend` turns that off.
"""

from __future__ import annotations

import argparse
import bisect
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from services.env.builtins.arithmetic import ArithmeticEnv, ArithmeticOptions, score_answer  # noqa: E402
from services.launch.tiny_model import DEMO_TASK, QWEN2_5_0_5B, build_tiny_model  # noqa: E402

SHAPES = {"qwen2.5-0.5b": QWEN2_5_0_5B}  # --shape: a real model's shape, random weights


def build_model(args: argparse.Namespace) -> Path:
    """The benchmark's model (built once into .cache/): `--shape`'s, else `--hidden` × `--layers`."""
    if args.shape:
        return build_tiny_model(REPO / ".cache" / f"bench-{args.shape}-shape", shape=SHAPES[args.shape])
    directory = REPO / ".cache" / f"bench-qwen2-h{args.hidden}-l{args.layers}"
    return build_tiny_model(directory, hidden=args.hidden, layers=args.layers)


# ---------------------------------------------------------------------------------------------- TRL side


def run_trl(args: argparse.Namespace) -> dict:
    """Train with TRL's GRPOTrainer in this process; steady-state timings from a step callback."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise SystemExit(f"TRL is not installed ({exc}); run: .venv/bin/pip install -e '.[bench]'") from exc
    from transformers import TrainerCallback

    env = ArithmeticEnv(ArithmeticOptions(**DEMO_TASK))
    items = [env.prompt_at("train", i) for i in range(args.steps * args.prompts_per_step)]
    dataset = Dataset.from_list([{"prompt": p.text, "answer": p.reference_answer} for p in items])

    def exact_match(prompts, completions, answer, **_):
        return [score_answer(c, a)[0] for c, a in zip(completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs-trl-"),
        per_device_train_batch_size=args.prompts_per_step * args.group_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        num_iterations=1,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        beta=0.0,
        loss_type="grpo",
        epsilon=0.2,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        optim="adamw_torch",
        max_steps=args.steps,
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        shuffle_dataset=False,
        disable_tqdm=True,
        seed=args.seed,
    )
    stamps: list[float] = []
    cpu_stamps: list[float] = []  # this process's CPU seconds (every thread) at each step's end
    generation_s: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *_, **__):
            stamps.append(time.perf_counter())
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu_stamps.append(usage.ru_utime + usage.ru_stime)

    trainer = GRPOTrainer(
        model=str(args.model),
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        callbacks=[Stamp()],
    )
    generate = trainer._generate_and_score_completions  # TRL's whole rollout phase: generate + reward

    def timed_generate(*a, **kw):
        started = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            generation_s.append(time.perf_counter() - started)

    trainer._generate_and_score_completions = timed_generate
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    history = [row for row in trainer.state.log_history if "reward" in row]
    lengths = [row["completions/mean_length"] for row in history if "completions/mean_length" in row]
    skip = args.skip
    window = stamps[-1] - stamps[skip - 1]
    steps = len(stamps) - skip
    gen = sum(generation_s[skip:])
    cpu = cpu_stamps[-1] - cpu_stamps[skip - 1]
    return {
        "side": "trl",
        "steps_per_s": steps / window,
        "completions_per_s": steps * args.prompts_per_step * args.group_size / window,
        "learner_idle": gen / window,
        "generation_s": statistics.median(generation_s[skip:]),
        "train_s": (window - gen) / steps,
        "cpu_s": cpu / steps,
        "cores": cpu / window,
        "completion_len": statistics.mean(lengths) if lengths else float("nan"),
        "reward_first": history[0]["reward"] if history else float("nan"),
        "reward_last": history[-1]["reward"] if history else float("nan"),
        "wall_s": total,
    }


# ---------------------------------------------------------------------------------------- grpo-mesh side


def run_mesh(args: argparse.Namespace) -> dict:
    """`make demo`'s launcher with the same settings; timings from its metrics.jsonl."""
    run_dir = Path(tempfile.mkdtemp(prefix="vs-trl-mesh-"))
    command = [
        sys.executable,
        "-m",
        "services",  # = grpo-mesh demo (services/cli.py)
        "demo",
        "--model",
        str(args.model),
        "--steps",
        str(args.steps),
        "--run-dir",
        str(run_dir),
        "--group-size",
        str(args.group_size),
        "--groups-per-batch",
        str(args.prompts_per_step),
        "--max-tokens",
        str(args.max_tokens),
        "--lr",
        str(args.lr),
        "--warmup-steps",
        "0",
        "--eval-every",
        "0",
        "--transport",
        args.transport,
        "--engine",
        args.engine,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
    ]
    command += ["--cpus", args.cpus, "--no-lend-idle-cores" if args.no_lend else "--lend-idle-cores"]
    # no learner checkpoint inside the run (TRL's side saves none): on the GPU a 0.5B model's full
    # checkpoint stalled a train step by ~7.5 s
    command += ["--checkpoint-every", str(args.steps + 1)]
    command += ["--trace" if args.trace else "--no-trace"]
    started = time.perf_counter()
    launcher = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL)
    with TreeCpu(launcher.pid) as cpu:
        if launcher.wait() != 0:
            raise subprocess.CalledProcessError(launcher.returncode, command)
    total = time.perf_counter() - started
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "learner/step_time_s" in r]
    steady = rows[args.skip :]
    window = steady[-1]["time"] - rows[args.skip - 1]["time"]
    steps = len(steady)
    train = sum(r["learner/step_time_s"] for r in steady)
    gen = generation_per_step(run_dir / "trace.json", args.skip) if args.trace else float("nan")
    used = cpu.at(steady[-1]["time"]) - cpu.at(rows[args.skip - 1]["time"])
    result = {
        "side": "grpo-mesh",
        "steps_per_s": steps / window,
        "completions_per_s": steps * args.prompts_per_step * args.group_size / window,
        "learner_idle": 1.0 - train / window,
        "generation_s": gen,
        "train_s": train / steps,
        "cpu_s": used / steps,
        "cores": used / window,
        "sync_s": statistics.median(r.get("sync_ms", 0.0) for r in steady) / 1e3,
        "borrowed": sum(r.get("learner/borrowed_micro_batches", 0.0) for r in steady)
        / max(1.0, sum(r.get("learner/micro_batches", 0.0) for r in steady)),
        "completion_len": statistics.mean(r["learner/completion_len_mean"] for r in rows),
        "reward_first": rows[0]["reward_mean"],
        "reward_last": rows[-1]["reward_mean"],
        "wall_s": total,
        "run_dir": str(run_dir),
    }
    if not args.trace:  # the run's directory holds the learner's final checkpoint (1.6 GB for SmolLM2)
        shutil.rmtree(run_dir, ignore_errors=True)
        del result["run_dir"]
    return result


class TreeCpu:
    """CPU seconds (user + system) used so far by a process and every process under it, sampled by a
    thread every `interval` s with wall-clock times (the scheduler's metric rows carry `time.time()`):
    `at(t)` interpolates between samples. A process that exits keeps its last reading, so the total
    never goes down; children that live less than one interval may be missed (the services and vLLM's
    engine core live for the whole run)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self._root, self._interval = psutil.Process(pid), interval
        self._last: dict[tuple[int, float], float] = {}  # (pid, create_time) -> CPU seconds
        self.samples: list[tuple[float, float]] = []  # (time.time(), total CPU seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-cpu", daemon=True)

    def __enter__(self) -> TreeCpu:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self._interval):
                return

    def sample(self) -> None:
        try:
            processes = [self._root, *self._root.children(recursive=True)]
        except psutil.NoSuchProcess:
            processes = []
        for process in processes:
            try:
                times = process.cpu_times()
                self._last[(process.pid, process.create_time())] = times.user + times.system
            except psutil.NoSuchProcess:
                pass
        self.samples.append((time.time(), sum(self._last.values())))

    def at(self, when: float) -> float:
        """Total CPU seconds at wall-clock time `when` (linear between samples, clamped at the ends)."""
        times = [t for t, _ in self.samples]
        i = bisect.bisect_left(times, when)
        if i == 0 or i == len(times):
            return self.samples[min(i, len(times) - 1)][1]
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1


def generation_per_step(trace: Path, skip: int) -> float:
    """Seconds per optimizer step in which at least one group was being generated: the union of the
    timeline's `generate` spans over the steady window (from the end of train step `skip` to the end of
    the last), divided by the steps in it. NaN without a timeline."""
    if not trace.exists():
        return float("nan")
    events = json.loads(trace.read_text())
    ends = sorted(e["ts"] + e["dur"] for e in events if e.get("ph") == "X" and e["name"] == "train step")
    if len(ends) <= skip:
        return float("nan")
    start, stop = ends[skip - 1] if skip else 0.0, ends[-1]
    opened: dict[tuple, float] = {}
    spans = []
    for e in sorted((e for e in events if e.get("name") == "generate"), key=lambda e: e["ts"]):
        key = (e.get("cat"), json.dumps(e.get("id2"), sort_keys=True))
        if e["ph"] == "b":
            opened[key] = e["ts"]
        elif e["ph"] == "e" and key in opened:
            spans.append((max(opened.pop(key), start), min(e["ts"], stop)))
    busy, reach = 0.0, start
    for begin, end in sorted(spans):
        begin = max(begin, reach)
        if end > begin:
            busy += end - begin
            reach = end
    return busy / 1e6 / (len(ends) - skip)


# ------------------------------------------------------------------------------------------------ driver


def side_command(args: argparse.Namespace, side: str) -> list[str]:
    flags = ["--side", side, "--model", str(args.model), "--steps", str(args.steps), "--skip", str(args.skip)]
    flags += ["--prompts-per-step", str(args.prompts_per_step), "--group-size", str(args.group_size)]
    flags += ["--max-tokens", str(args.max_tokens), "--lr", str(args.lr), "--transport", args.transport]
    flags += ["--seed", str(args.seed), "--engine", args.engine, "--cpus", args.cpus]
    flags += ["--device", args.device, "--dtype", args.dtype]
    flags += ["--no-lend"] if args.no_lend else []
    flags += ["--trace"] if args.trace else []
    return [sys.executable, str(Path(__file__).resolve()), *flags]


def run_side(args: argparse.Namespace, side: str) -> dict:
    out = subprocess.run(side_command(args, side), cwd=REPO, check=True, stdout=subprocess.PIPE, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(results: list[dict]) -> dict:
    by_side: dict[str, list[dict]] = {}
    for r in results:
        by_side.setdefault(r["side"], []).append(r)
    summary = {
        side: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], float)}
        for side, rs in by_side.items()
    }
    ratios = [
        m["steps_per_s"] / t["steps_per_s"]
        for m, t in zip(by_side["grpo-mesh"], by_side["trl"], strict=False)
    ]
    summary["ratio_steps_per_s"] = {"median": statistics.median(ratios), "each": ratios}
    return summary


def print_table(summary: dict, args: argparse.Namespace) -> None:
    print(
        f"\nmodel {args.model.name}: G={args.group_size} × {args.prompts_per_step} prompts/step, "
        f"≤{args.max_tokens} tokens, steps {args.skip + 1}..{args.steps} (medians of {args.repeats} rounds)"
    )
    keys = ["steps_per_s", "completions_per_s", "learner_idle", "generation_s", "train_s", "cpu_s", "cores"]
    keys += ["completion_len"]
    print(f"{'':>10} " + " ".join(f"{k:>{max(7, len(k))}}" for k in keys))
    for side in ("trl", "grpo-mesh"):
        row = summary[side]
        print(f"{side:>10} " + " ".join(f"{row.get(k, float('nan')):>{max(7, len(k))}.3f}" for k in keys))
    ratio = summary["ratio_steps_per_s"]
    each = ", ".join(f"{r:.2f}" for r in ratio["each"])
    print(f"grpo-mesh / TRL optimizer steps/s: {ratio['median']:.2f}× (rounds: {each})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=128, help="Model width (multiple of 64).")
    parser.add_argument("--layers", type=int, default=2, help="Model depth.")
    parser.add_argument("--model", type=Path, help="A model directory instead of --hidden/--layers.")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        help="A real model's shape instead of --hidden/--layers (random weights, the demo's tokenizer).",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="Both sides: cpu, or cuda (TRL on the GPU; grpo-mesh's learner and transformers rollout).",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="Both sides: fp32, or bf16 autocast over fp32 master weights (TRL: --bf16; the demo: --dtype).",
    )
    parser.add_argument("--steps", type=int, default=40, help="Optimizer steps per side and round.")
    parser.add_argument("--skip", type=int, default=5, help="First steps left out of the steady window.")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--transport", default="shared_memory", help="grpo-mesh weight transport.")
    parser.add_argument(
        "--engine", default="vllm", choices=["vllm", "transformers"], help="grpo-mesh rollout engine."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-lend",
        action="store_true",
        help="Under --cpus split, keep the rollout's cores from the learner even while it is idle.",
    )
    parser.add_argument("--repeats", type=int, default=2, help="Rounds; sides alternate in order.")
    parser.add_argument(
        "--cpus",
        default="split",
        choices=["split", "shared"],
        help="grpo-mesh: how learner and rollouts share the cores (the demo's --cpus).",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="grpo-mesh: record each round's timeline (<run_dir>/trace.json, ui.perfetto.dev).",
    )
    parser.add_argument("--side", choices=["trl", "grpo-mesh"], help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="Print the summary as JSON.")
    args = parser.parse_args(argv)
    if args.skip < 1 or args.steps <= args.skip + 1:
        parser.error("need 1 <= --skip < --steps - 1")
    if args.model is None:
        args.model = build_model(args)
    if args.side:
        result = run_trl(args) if args.side == "trl" else run_mesh(args)
        print(json.dumps(result))
        return 0
    results = []
    for round_ in range(args.repeats):
        order = ["trl", "grpo-mesh"] if round_ % 2 == 0 else ["grpo-mesh", "trl"]
        for side in order:
            result = run_side(args, side)
            results.append(result)
            print(
                f"round {round_ + 1} {side:>10}: {result['steps_per_s']:.3f} steps/s, "
                f"idle {result['learner_idle']:.2f}, train step {result['train_s']:.1f} s, "
                f"CPU {result['cpu_s']:.1f} s/step, wall {result['wall_s']:.0f} s"
                + (
                    f", micro-batches on borrowed cores {result['borrowed']:.0%}"
                    if "borrowed" in result
                    else ""
                )
                + (
                    f", timeline {result['run_dir']}/trace.json" if args.trace and side == "grpo-mesh" else ""
                ),
                flush=True,
            )
    summary = summarize(results)
    print(json.dumps(summary, indent=2) if args.json else "", end="")
    print_table(summary, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
