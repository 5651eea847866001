"""`make demo`: the embedded default run, end to end on one machine.

Builds the tiny model if needed, writes one run-config file for all four services, starts them as
local processes (env, learner and rollout first, the scheduler once they are ready), follows the
run with a progress bar, restarts any service that crashes (`supervisor.py`: same port, back-off,
a restart limit; the run continues from the scheduler's ledger and the learner's checkpoints), stops
everything with SIGTERM (also when the launcher itself gets SIGTERM or Ctrl-C), and writes
`metrics.jsonl`, `reward.png` and `summary.json` into the run directory. A new run starts clean
(previous ledger, checkpoints and metrics of the run directory removed) unless `--resume`.

One launcher runs a run directory at a time (a second one is refused); its services die with it, even
when it is killed with SIGKILL, and a launcher that finds services a dead one left running stops them
before it starts its own (`ownership.py`).

    grpo-mesh demo --steps 40 --run-dir runs/demo [--model PATH_OR_ID] [--loss dapo] [--secure] [--resume]

(`make demo` runs it; `python -m services demo` without the console script.) Booleans are bare
`--flag` / `--no-flag` (`--no-lend-idle-cores`), like every grpo-mesh command line.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Literal

import tomli_w
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from tqdm import tqdm

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.advantages import LossKind
from services.common.clients import GrpcClient
from services.common.config import parse_cli
from services.common.cpus import format_cpu_list, split_cores
from services.common.errors import GrpoError
from services.common.security import ClientSecurity, SecuritySettings, set_client_security
from services.launch import pretrained
from services.launch.certs import RunCredentials, issue
from services.launch.fronts import keep_open, start_fronts, start_studio
from services.launch.ownership import RunDirBusy, RunOwner
from services.launch.processes import ServiceFailed, ServiceProcess, terminate_all
from services.launch.report import last_row, plot_reward, read_metrics, summarize
from services.launch.supervisor import RestartPolicy, Supervisor
from services.launch.tiny_model import DEMO_TASK, build_tiny_model
from services.transports import TransportKind
from services.transports.kinds import ImplementedTransport

REPO = Path(__file__).resolve().parents[2]


def default_model_dir(warm_start_steps: int) -> Path:
    """Where the demo keeps the tiny model built with this many warm-start steps (built once)."""
    return REPO / ".cache" / f"tiny-model-warm{warm_start_steps}"


class DemoSettings(BaseSettings):
    """Options of the embedded demo run (also `GRPO_DEMO__*` env vars)."""

    model_config = SettingsConfigDict(
        env_prefix="GRPO_DEMO__", cli_kebab_case=True, cli_implicit_flags=True, extra="forbid"
    )

    steps: int = Field(default=400, ge=1, description="Optimizer steps to run.")
    run_dir: Path = Field(
        default=Path("runs/demo"), description="Output directory (metrics.jsonl, reward.png, logs/)."
    )
    model: str = Field(
        default="",
        description="HF model id or local path; empty = build the tiny model; smollm2-135m = SmolLM2-135M-"
        "Instruct from PyPI with its own preset of the other options (docs/real-model.md).",
    )
    warm_start_steps: int = Field(
        default=120, ge=0, description="Supervised warm-start steps of the tiny model."
    )
    engine: Literal["auto", "vllm", "transformers"] = Field(default="auto", description="Rollout engine.")
    device: str = Field(
        default="auto",
        description="Where the learner and a transformers-engine rollout run: auto (cuda if available, "
        "else cpu), cpu, cuda, cuda:1 (vLLM runs where its build does).",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Learner compute (autocast; master weights stay fp32), published weights and rollout "
        "weights. bfloat16 is for GPUs; float32 keeps learner and rollout logprobs within 1e-4.",
    )
    rollouts: int = Field(default=1, ge=1, description="Number of rollout processes.")
    learner_ranks: int = Field(
        default=1,
        ge=1,
        description="Learner processes (torchrun --nproc-per-node): the model, its gradients and optimizer "
        "state sharded over them with FSDP2 (docs/distributed-learner.md); 1 = one plain process.",
    )
    cpus: Literal["split", "shared"] = Field(
        default="split",
        description="split: the learner and the rollouts get disjoint halves of this machine's cores (each "
        "rollout its own share when there are enough), so their thread pools never fight over a core; "
        "shared: every service may use every core.",
    )
    lend_idle_cores: bool = Field(
        default=True,
        description="Under split, the learner borrows the rollouts' cores while no rollout has work "
        "(it looks at every forward and backward pass and every decoder layer's; services/common/cpus.py).",
    )
    env: str = Field(
        default="arithmetic", description="Environment spec (built-in name, module:Class, file.py:Class)."
    )
    env_arg: list[str] = Field(default_factory=list, description="Environment option key=value (repeatable).")
    source: Literal["env", "external"] = Field(
        default="env",
        description="Where train groups come from: env = the env service (--env); external = submitted "
        "through the gateway's trajectory API by an external harness (implied by --harness; without one, "
        "start your harness against the gateway URL the launcher prints).",
    )
    harness: str = Field(
        default="",
        description="A command that generates through the gateway and submits scored groups (an atropos "
        "env's `serve`, the verifiers runner; docs/ecosystem.md). With it the run's source is external: "
        "no env service, a gateway serving the trajectory API, and the command started once the gateway "
        "is ready, with {gateway} (its URL), {model}, {group_size}, {groups_per_batch}, {steps}, "
        "{max_tokens}, {temperature}, {seed}, {run_dir}, {python} (this Python), {max_staleness} and "
        "{batches_ahead} (max_staleness + 1: atropos' --env.max_batches_offpolicy) filled in.",
    )
    loss: LossKind = Field(default=LossKind.grpo, description="Objective.")
    lr: float = Field(default=4e-4, gt=0, description="Learner learning rate.")
    warmup_steps: int = Field(default=30, ge=0, description="Learner linear LR warmup steps.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        default="cosine",
        description="LR after warmup: cosine decays to --min-lr-ratio × lr at the last step (a policy that "
        "settles instead of oscillating at full LR to the end), constant keeps lr.",
    )
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="Cosine floor as a fraction of lr.")
    lora_rank: int = Field(default=0, ge=0, description="LoRA rank; 0 = full fine-tune.")
    lora_sync: Literal["adapter", "merged"] = Field(
        default="adapter",
        description="With LoRA, what a weight version carries: the adapter tensors alone, which the "
        "rollouts serve over their base model (vLLM's LoRA support, peft on the transformers engine), "
        "or the whole model with the adapter merged in (docs/weight-sync.md).",
    )
    transport: ImplementedTransport = Field(
        default=TransportKind.grpc_stream,
        description="Weight transport: grpc_stream, shared_memory, nccl (Gloo on CPU); cuda_ipc needs a GPU.",
    )
    group_size: int = Field(default=8, ge=2, description="Completions per prompt.")
    groups_per_batch: int = Field(default=16, ge=1, description="Prompt groups per step.")
    max_tokens: int = Field(default=6, ge=1, description="Max completion tokens.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature.")
    eval_temperature: float | None = Field(
        default=None, gt=0, description="Eval sampling temperature; unset = --temperature."
    )
    max_staleness: int = Field(default=1, ge=0, description="Max policy lag in versions.")
    seed: int | None = Field(
        default=None,
        description="Seed of the run: the env's prompt stream (and its held-out split), the learner and "
        "the rollout engines; unset = each service's default (0).",
    )
    curriculum: bool = Field(
        default=False,
        description="Draw train prompts from the env's difficulty levels by their recent success rate "
        "(e.g. --env-arg levels=1-4 for arithmetic); the band and window are the scheduler's "
        "curriculum options (GRPO_SCHEDULER__CURRICULUM__BAND_LOW, ...; docs/configuration.md).",
    )
    studio: bool = Field(
        default=False,
        description="Open the web studio on this run (127.0.0.1, a free port; its URL is printed and "
        "written to <run-dir>/studio.url; docs/studio.md). It stops with the run.",
    )
    eval_every: int = Field(default=100, ge=0, description="Evaluate every N steps (and at step 0); 0 = off.")
    eval_prompts: int = Field(default=200, ge=1, description="Held-out prompts per evaluation.")
    eval_samples: int = Field(
        default=8, ge=1, description="Completions per held-out prompt (accuracy over all)."
    )
    startup_timeout: float = Field(
        default=900.0, gt=0, description="Seconds for all services to become ready."
    )
    checkpoint_every: int = Field(
        default=10,
        ge=1,
        description="Learner checkpoint interval in steps: a learner crash re-trains at most this many "
        "steps minus one (a checkpoint of the tiny model takes ~12 ms; 10 demo steps take ~5 s).",
    )
    max_restarts: int = Field(
        default=5, ge=0, description="Restarts of one crashed service within 10 minutes before the run fails."
    )
    resume: bool = Field(
        default=False,
        description="Continue the run in --run-dir (its ledger and checkpoints) instead of starting clean.",
    )
    secure: bool = Field(
        default=False,
        description="Mutual TLS and a bearer token on every RPC: a throwaway CA, certificates and token are "
        "made in <run-dir>/tls/ (grpcurl: -cacert ca.pem -cert operator.pem -key operator.key; "
        "`grpo-mesh certs` makes the same for services run by hand).",
    )
    metrics: bool = Field(
        default=True,
        description="Prometheus /metrics on a free port per service (<run-dir>/<svc>.metrics-port).",
    )
    trace: bool = Field(
        default=False,
        description="<run-dir>/trace.json: the run's timeline (groups, train steps, sync phases) for "
        "ui.perfetto.dev (the scheduler's `trace`).",
    )

    @property
    def external(self) -> bool:
        """Train groups come from the gateway's trajectory API (source external, or a harness given)."""
        return self.source == "external" or bool(self.harness)


def rollout_in_flight(cfg: DemoSettings) -> int:
    """Requests a rollout holds at once: the groups of max_staleness + 1 steps."""
    return cfg.groups_per_batch * (cfg.max_staleness + 1)


def run_config(cfg: DemoSettings, model: str, creds: RunCredentials | None = None) -> dict:
    """The one run-config file shared by the four services (a table each, plus the shared
    `[security]` and `[telemetry]` tables every service reads)."""
    env_args = {} if cfg.env_arg or cfg.env != "arithmetic" else dict(DEMO_TASK)
    run_dir = cfg.run_dir.resolve()
    seed = {} if cfg.seed is None else {"seed": cfg.seed}
    shared: dict = {}
    if creds is not None:
        shared["security"] = creds.security_table(mutual=True)
    if cfg.metrics:
        shared["telemetry"] = {"metrics_port": 0}
    external = cfg.external
    adapters = cfg.lora_rank > 0 and cfg.lora_sync == "adapter"
    return {
        **shared,
        "env": {"spec": cfg.env, "env_args": env_args, "env_arg": cfg.env_arg, **seed},
        # source = external: the gateway's trajectory API feeds the scheduler (its addresses are set
        # by the launcher once the scheduler is up)
        "gateway": {"served_model_name": "grpo-mesh", "trajectories": {"hold_s": 120.0}},
        "learner": {
            "model": model,
            **seed,
            "device": cfg.device,
            "dtype": cfg.dtype,
            "loss": {"kind": cfg.loss.value, "max_completion_len": cfg.max_tokens},
            "optim": {
                "lr": cfg.lr,
                "warmup_steps": cfg.warmup_steps,
                "schedule": cfg.lr_schedule,
                "total_steps": cfg.steps,
                "min_lr_ratio": cfg.min_lr_ratio,
            },
            "lora": {"rank": cfg.lora_rank},
            "publish": {"export_dtype": cfg.dtype, "export_format": "adapter" if adapters else "full"},
            # a restarted learner resumes from its newest checkpoint (and a fresh run has none)
            "checkpoint": {
                "dir": str(run_dir / "checkpoints"),
                "every": cfg.checkpoint_every,
                "resume": True,
            },
        },
        "rollout": {
            "model": model,
            "engine": cfg.engine,
            **seed,
            "dtype": cfg.dtype,
            "max_in_flight": rollout_in_flight(cfg),
            "vllm": {"kv_cache_space_gib": 1, "max_lora_rank": cfg.lora_rank if adapters else 0},
            "hf": {"device": cfg.device},
        },
        "scheduler": {
            "group_size": cfg.group_size,
            "groups_per_batch": cfg.groups_per_batch,
            "max_steps": cfg.steps,
            "max_staleness": cfg.max_staleness,
            "weight_transport": cfg.transport.value,
            "source": "external" if external else "env",
            "eval_every": 0 if external else cfg.eval_every,
            "eval_prompts": cfg.eval_prompts,
            "eval_samples": cfg.eval_samples,
            "eval_temperature": cfg.eval_temperature or cfg.temperature,
            "run_dir": str(run_dir),
            "trace": cfg.trace,
            "curriculum": {"enabled": cfg.curriculum, "seed": cfg.seed or 0},
            # bf16 logprobs of the learner (autocast) and the rollout (bf16 weights) differ by far more
            # than fp32's 1e-3: the probe's figure is still logged, but only fp32 fails the run on it
            "alignment_action": "fail" if cfg.dtype == "float32" else "warn",
            "sampling": {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens},
            # a real model's probe comes right after a commit, while its rollout re-prefills every
            # request in flight on its one core: measured on SmolLM2 (2 cores), past 2 s + the tokens'
            # share at every sync, which skipped every probe and took the rollout out of work
            **({"timeouts": {"probe": PRETRAINED_PROBE_S}} if cfg.model else {}),
        },
    }


PRETRAINED_PROBE_S = 60.0  # the scheduler's probe deadline for a model other than the tiny one


def learner_runner(cfg: DemoSettings) -> list[str]:
    """How the learner's module is started: plain Python, or torchrun (through `torchrun.py`, for a clean
    stop) with one process per rank (a rendezvous of its own on this host; any rank failing takes the
    others down: the supervisor restarts the learner as a whole)."""
    if cfg.learner_ranks == 1:
        return [sys.executable, "-m"]
    return [
        sys.executable, "-m", "services.launch.torchrun", "--standalone", "--nproc-per-node",
        str(cfg.learner_ranks), "--max-restarts", "0", "-m",
    ]  # fmt: skip


def core_plan(cfg: DemoSettings) -> tuple[dict[str, str], list[dict[str, str]]]:
    """`GRPO_<SVC>__CPUS` for the learner and each rollout: disjoint halves of the cores under `split`
    (rollouts share theirs when there are more rollouts than cores), nothing under `shared` or on a
    single core. The env and scheduler stay unpinned: they are light and mostly wait; so does each
    rollout's own process once its vLLM engine runs (`service_cpus`: every core), leaving the engine
    its cores alone. With `lend_idle_cores`, each rollout keeps a busy file and the learner borrows
    the rollouts' cores."""
    cores = sorted(os.sched_getaffinity(0))
    if cfg.cpus == "shared" or len(cores) < 2:
        return {}, [{} for _ in range(cfg.rollouts)]
    rollout_cores, learner_cores = split_cores(cores, 0.5)
    if len(rollout_cores) >= cfg.rollouts:
        shares = [rollout_cores[i :: cfg.rollouts] for i in range(cfg.rollouts)]
    else:
        shares = [rollout_cores] * cfg.rollouts
    learner = {"GRPO_LEARNER__CPUS": format_cpu_list(learner_cores)}
    everything = format_cpu_list(set(cores))
    rollouts = [
        {"GRPO_ROLLOUT__CPUS": format_cpu_list(share), "GRPO_ROLLOUT__SERVICE_CPUS": everything}
        for share in shares
    ]
    if cfg.lend_idle_cores and cfg.learner_ranks == 1:  # a sharded learner keeps to its own cores
        busy_files = [str(cfg.run_dir.resolve() / f"rollout-{i}.busy") for i in range(cfg.rollouts)]
        for rollout, busy_file in zip(rollouts, busy_files, strict=True):
            rollout["GRPO_ROLLOUT__BUSY_FILE"] = busy_file
        learner["GRPO_LEARNER__BORROW__CPUS"] = format_cpu_list(rollout_cores)
        learner["GRPO_LEARNER__BORROW__BUSY_FILES"] = json.dumps(busy_files)
    return learner, rollouts


async def follow(
    scheduler_address: str, cfg: DemoSettings, supervisor: Supervisor, harness: ServiceProcess | None = None
) -> scheduler_pb2.GetStatusResponse:
    """Poll the scheduler until the run finishes or fails, drawing a progress bar; restart crashed
    services meanwhile (the scheduler may be unreachable while it restarts)."""
    scheduler = GrpcClient(scheduler_address, scheduler_pb2_grpc.SchedulerServiceStub)
    unreachable_since: float | None = None
    try:
        with tqdm(total=cfg.steps, desc="training", unit="step") as bar:
            supervisor.say = bar.write
            while True:
                supervisor.check()
                if harness is not None and harness.process is not None and harness.process.poll():
                    harness.check_alive()  # a harness that failed fails the run (0: it is done)
                try:
                    status = await scheduler.unary("GetStatus", scheduler_pb2.GetStatusRequest(), 10.0)
                except GrpoError:
                    unreachable_since = unreachable_since or time.monotonic()
                    if time.monotonic() - unreachable_since > cfg.startup_timeout:
                        raise ServiceFailed("the scheduler stayed unreachable") from None
                    await asyncio.sleep(1.0)
                    continue
                unreachable_since = None
                bar.update(status.step - bar.n)
                row = last_row(cfg.run_dir)
                if row and "reward_mean" in row:
                    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", v=status.learner_version)
                if status.finished or status.error:
                    return status
                await asyncio.sleep(1.0)
    finally:
        await scheduler.close()


def clean_run_dir(run_dir: Path) -> None:
    """What an earlier run left that a new one must not continue: its ledger, checkpoints, metrics."""
    for name in ("metrics.jsonl", "ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


async def run_demo(cfg: DemoSettings) -> int:
    """The whole run: claim the run directory (refused while another launcher runs it; what a dead
    one left running is stopped), run, stop the services, then let go of the directory (its record
    removed, stale shared memory reclaimed)."""
    started = time.perf_counter()
    # SIGTERM / Ctrl-C: cancel the run, so the `finally`s stop every service (no orphans)
    task = asyncio.current_task()
    assert task is not None
    for signum in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(signum, task.cancel)
    try:
        owner = await asyncio.to_thread(RunOwner.claim, cfg.run_dir)
    except RunDirBusy as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except asyncio.CancelledError:
        return 143
    try:
        return await _run(cfg, owner, started)
    finally:
        owner.release()  # blocking, but the loop has nothing else left to run


async def _run(cfg: DemoSettings, owner: RunOwner, started: float) -> int:
    if not cfg.resume:
        clean_run_dir(cfg.run_dir)
    model = cfg.model
    if known := pretrained.lookup(model):
        model = str(await asyncio.to_thread(pretrained.prepare_model, known, REPO / ".cache"))
        print(f"{known.name}: {model}", flush=True)
    elif not model:
        model_dir = default_model_dir(cfg.warm_start_steps)
        print(f"tiny model: {model_dir} (built once)", flush=True)
        model = str(
            await asyncio.to_thread(build_tiny_model, model_dir, warm_start_steps=cfg.warm_start_steps)
        )
    creds = None
    if cfg.secure:
        creds = issue(cfg.run_dir.resolve() / "tls")
        # the launcher's own calls (health checks, status) go through the same TLS and token
        set_client_security(ClientSecurity.from_settings(SecuritySettings(**creds.security_table())))
        print(f"security: mutual TLS + bearer token (credentials in {creds.directory})", flush=True)
    config_path = cfg.run_dir / "run.toml"
    config_path.write_text(tomli_w.dumps(run_config(cfg, model, creds)))
    common = ["--config", str(config_path)]
    learner_cpus, rollout_cpus = core_plan(cfg)
    workers = [] if cfg.external else [ServiceProcess("env", cfg.run_dir, common)]
    workers += [ServiceProcess("learner", cfg.run_dir, common, env=learner_cpus, runner=learner_runner(cfg))]
    workers += [
        ServiceProcess(
            "rollout",
            cfg.run_dir,
            [*common, "--rollout-id", f"rollout-{i}"],
            env=rollout_cpus[i],
            label=f"rollout-{i}",
        )
        for i in range(cfg.rollouts)
    ]
    for proc in workers:
        owner.track(proc)
    scheduler = studio = None
    fronts: list[ServiceProcess] = []  # source = external: the gateway, then the harness
    supervisor = Supervisor(workers, RestartPolicy(max_restarts=cfg.max_restarts))
    try:
        for proc in workers:
            proc.start()
        print("starting services (first start compiles the model; this can take a minute) ...", flush=True)
        addresses = await asyncio.gather(*(p.wait_ready(cfg.startup_timeout) for p in workers))
        by_name = dict(zip([p.name for p in workers], addresses, strict=False))
        rollout_addresses = [a for p, a in zip(workers, addresses, strict=True) if p.name == "rollout"]
        scheduler = ServiceProcess(
            "scheduler",
            cfg.run_dir,
            common,
            env={
                **({"GRPO_SCHEDULER__ENV_ADDRESS": by_name["env"]} if "env" in by_name else {}),
                "GRPO_SCHEDULER__LEARNER_ADDRESS": by_name["learner"],
                "GRPO_SCHEDULER__ROLLOUT_ADDRESSES": json.dumps(rollout_addresses),
            },
        )
        owner.track(scheduler)
        scheduler.start()
        address = await scheduler.wait_ready(cfg.startup_timeout)
        supervisor.add(scheduler)
        if cfg.external:
            fronts = await start_fronts(cfg, model, common, address, rollout_addresses, owner, supervisor)
        if cfg.metrics:
            print(
                "metrics: " + ", ".join(f"{p.tag} {p.metrics_url()}" for p in [*workers, scheduler]),
                flush=True,
            )
        harness = fronts[-1] if cfg.harness else None
        if cfg.studio:
            studio = await start_studio(
                cfg.run_dir, creds.token if creds else None, owner, cfg.startup_timeout
            )
        status = await follow(address, cfg, supervisor, harness)
    except ServiceFailed as exc:
        print(f"\nerror: {exc}", flush=True)
        terminate_all([studio] if studio else [])
        return 1
    except asyncio.CancelledError:
        print("\nstopped: every service was sent SIGTERM", flush=True)
        terminate_all([studio] if studio else [])
        return 143
    finally:
        terminate_all(fronts[::-1] + ([scheduler] if scheduler else []) + workers[::-1])
    code = report(cfg, status, time.perf_counter() - started, dict(supervisor.restarts))
    if studio is not None:
        await keep_open(studio)  # the finished run stays open in the studio until Ctrl-C
    return code


def report(
    cfg: DemoSettings, status: scheduler_pb2.GetStatusResponse, wall_s: float, restarts: dict[str, int]
) -> int:
    rows = read_metrics(cfg.run_dir)
    summary = {**summarize(rows), "wall_s": round(wall_s, 1), "error": status.error, "restarts": restarts}
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if rows:
        plot_reward(rows, cfg.run_dir / "reward.png")
    print(json.dumps(summary, indent=2))
    if status.error:
        print(f"run failed: {status.error} (logs in {cfg.run_dir / 'logs'})")
        return 1
    print(f"wrote {cfg.run_dir / 'metrics.jsonl'} and {cfg.run_dir / 'reward.png'}")
    return 0


PROG = "grpo-mesh demo"


def parse(argv: list[str], prog: str = PROG) -> DemoSettings:
    """The demo's settings from its command line (and `GRPO_DEMO__*`), with a known model's preset
    applied under the flags given; SystemExit(2) on a bad command line."""
    return pretrained.with_model_preset(parse_cli(DemoSettings, argv, prog))


def main(argv: list[str]) -> int:
    cfg = parse(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return asyncio.run(run_demo(cfg))
