"""source = external: what the launcher starts in front of the scheduler (`grpo-mesh demo --source
external` / `--harness CMD`): the gateway, serving inference and atropos' trajectory API, then the
harness command that talks to it (docs/ecosystem.md)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Protocol

from services.launch.ownership import RunOwner
from services.launch.processes import ServiceProcess
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
