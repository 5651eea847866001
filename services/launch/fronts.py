"""What the launcher starts in front of the scheduler: with source = external (`grpo-mesh demo --source
external` / `--harness CMD`), the gateway, serving inference and atropos' trajectory API, then the
harness command that talks to it (docs/ecosystem.md); with `--studio`, the web studio on the run
(docs/studio.md)."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Protocol

from services.launch.ownership import RunOwner
from services.launch.processes import ServiceFailed, ServiceProcess, terminate_all
from services.launch.supervisor import Supervisor


class FrontSettings(Protocol):
    """What of the demo's settings the fronts read (`DemoSettings` has them)."""

    run_dir: Path
    harness: str
    startup_timeout: float
    group_size: int
    groups_per_batch: int
    max_staleness: int
    steps: int
    max_tokens: int
    temperature: float
    seed: int | None


async def start_fronts(
    cfg: FrontSettings, model: str, common: list[str], scheduler: str, rollouts: list[str],
    owner: RunOwner, supervisor: Supervisor,
) -> list[ServiceProcess]:  # fmt: skip
    """source = external: the gateway (generation, the trajectory API; supervised like a service)
    in front of the rollouts and the scheduler, then the harness command, which talks to it."""
    in_flight = cfg.groups_per_batch * (cfg.max_staleness + 1)  # the rollouts' max_in_flight (run_config)
    gateway = ServiceProcess(
        "gateway",
        cfg.run_dir,
        common,
        env={
            "GRPO_GATEWAY__ROLLOUTS": json.dumps(rollouts),
            "GRPO_GATEWAY__TRAJECTORIES__SCHEDULER": scheduler,
            "GRPO_GATEWAY__ADMISSION__SCHEDULER": scheduler,
            "GRPO_GATEWAY__ADMISSION__MAX_STALENESS": str(cfg.max_staleness),
            # no more requests on a rollout than the scheduler itself keeps there: beyond, they wait
            # in the engine's queue, and so does a probe's ScoreTokens behind them
            "GRPO_GATEWAY__ADMISSION__PER_ROLLOUT_IN_FLIGHT": str(in_flight),
        },
        readiness="http",
    )
    owner.track(gateway)
    gateway.start()
    url = "http://" + await gateway.wait_ready(cfg.startup_timeout)
    supervisor.add(gateway)
    fields = {
        "gateway": url, "model": model, "group_size": cfg.group_size, "steps": cfg.steps,
        "groups_per_batch": cfg.groups_per_batch, "max_tokens": cfg.max_tokens,
        "temperature": cfg.temperature, "seed": cfg.seed if cfg.seed is not None else 0,
        "run_dir": cfg.run_dir.resolve(), "python": sys.executable, "max_staleness": cfg.max_staleness,
        # batches a harness may keep generated ahead and waiting (atropos' max_batches_offpolicy): more
        # would be stale by the time they train
        "batches_ahead": cfg.max_staleness + 1,
    }  # fmt: skip
    (cfg.run_dir / "gateway.url").write_text(url)
    print(f"gateway: {url} (inference and the trajectory API)", flush=True)
    if not cfg.harness:
        return [gateway]
    command = [part.format(**fields) for part in shlex.split(cfg.harness)]
    harness = ServiceProcess("harness", cfg.run_dir, command=command)
    owner.track(harness)
    harness.start()
    print(f"harness: {shlex.join(command)} (log: {harness.log_file})", flush=True)
    return [gateway, harness]


async def start_studio(
    run_dir: Path,
    token_file: Path | None,
    owner: RunOwner,
    timeout: float,  # noqa: ASYNC109 (a polling deadline)
) -> ServiceProcess:
    """`grpo-mesh studio` on this run (a free port on 127.0.0.1; the run's token when it has one), its
    URL printed and written to `<run_dir>/studio.url`. Not supervised: a dead studio is not the run's."""
    port_file = run_dir / "studio.port"
    port_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "services", "studio", "--port", "0", "--port-file", str(port_file)]
    command += ["--runs-root", str(run_dir.parent), "--run-dir", str(run_dir)]  # the same cwd as ours
    if token_file is not None:
        command += ["--token-file", str(token_file)]
    studio = ServiceProcess("studio", run_dir, command=command)
    owner.track(studio)
    studio.start()
    deadline = time.monotonic() + timeout
    while not (port_file.exists() and port_file.read_text().strip()):
        studio.check_alive()
        if time.monotonic() > deadline:
            raise ServiceFailed(f"the studio did not bind a port within {timeout:.0f}s:\n{studio.log_tail()}")
        await asyncio.sleep(0.2)
    url = f"http://127.0.0.1:{int(port_file.read_text())}/"
    (run_dir / "studio.url").write_text(url)
    print(f"studio: {url}" + (f" (token: {token_file})" if token_file else ""), flush=True)
    return studio


async def keep_open(studio: ServiceProcess) -> None:
    """Leave the studio serving the finished run until Ctrl-C (or SIGTERM), or until it exits."""
    print(f"the studio stays open on the finished run: {(studio.run_dir / 'studio.url').read_text()} "
          "(Ctrl-C closes it)", flush=True)  # fmt: skip
    try:
        while studio.process is not None and studio.process.poll() is None:  # noqa: ASYNC110 (a child's exit)
            await asyncio.sleep(0.5)
    except asyncio.CancelledError:
        pass
    finally:
        terminate_all([studio])
