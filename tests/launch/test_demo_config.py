"""The demo launcher's run config: core split between learner and rollouts, seed, LR schedule."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.launch.demo import DemoSettings, core_plan, run_config
from services.learner.config import LearnerSettings
from services.rollout.config import RolloutSettings


def _cores(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


def test_split_gives_learner_and_rollout_disjoint_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 2)
    learner, rollouts = core_plan(DemoSettings(lend_idle_cores=False))
    assert learner == {"GRPO_LEARNER__CPUS": "1"}
    assert rollouts == [{"GRPO_ROLLOUT__CPUS": "0", "GRPO_ROLLOUT__SERVICE_CPUS": "0-1"}]


def test_rollouts_get_their_own_share_when_there_are_enough_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 8)
    learner, rollouts = core_plan(DemoSettings(rollouts=2, lend_idle_cores=False))
    assert learner == {"GRPO_LEARNER__CPUS": "4-7"}
    assert [r["GRPO_ROLLOUT__CPUS"] for r in rollouts] == ["0,2", "1,3"]
    assert all(r["GRPO_ROLLOUT__SERVICE_CPUS"] == "0-7" for r in rollouts)  # front ends float
    _cores(monkeypatch, 2)
    plan = core_plan(DemoSettings(rollouts=3, lend_idle_cores=False))
    assert plan[1] == [{"GRPO_ROLLOUT__CPUS": "0", "GRPO_ROLLOUT__SERVICE_CPUS": "0-1"}] * 3


def test_the_learner_borrows_every_rollouts_cores_through_their_busy_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _cores(monkeypatch, 8)
    learner, rollouts = core_plan(DemoSettings(rollouts=2, run_dir=tmp_path))
    busy = [str(tmp_path / "rollout-0.busy"), str(tmp_path / "rollout-1.busy")]
    assert [r["GRPO_ROLLOUT__BUSY_FILE"] for r in rollouts] == busy
    assert learner["GRPO_LEARNER__BORROW__CPUS"] == "0-3"
    for name, value in learner.items():
        monkeypatch.setenv(name, value)
    settings = LearnerSettings.load(model="m")  # the learner reads exactly what the launcher sets
    assert settings.cpus == "4-7" and settings.borrow.cpus == "0-3"
    assert settings.borrow.busy_files == [Path(p) for p in busy]
    for name, value in rollouts[1].items():
        monkeypatch.setenv(name, value)
    rollout = RolloutSettings.load(model="m")  # and each rollout too
    assert rollout.busy_file == Path(busy[1]) and rollout.cpus == "1,3" and rollout.service_cpus == "0-7"


def test_shared_or_single_core_pins_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    _cores(monkeypatch, 4)
    assert core_plan(DemoSettings(cpus="shared")) == ({}, [{}])
    _cores(monkeypatch, 1)
    assert core_plan(DemoSettings(rollouts=2)) == ({}, [{}, {}])


def test_seed_reaches_env_learner_and_rollout_only_when_given() -> None:
    config = run_config(DemoSettings(seed=3), "model-dir")
    assert config["env"]["seed"] == config["learner"]["seed"] == config["rollout"]["seed"] == 3
    config = run_config(DemoSettings(), "model-dir")
    assert "seed" not in config["env"] and "seed" not in config["learner"] and "seed" not in config["rollout"]


def test_cosine_schedule_spans_the_run() -> None:
    optim = run_config(DemoSettings(steps=123), "model-dir")["learner"]["optim"]
    assert optim["schedule"] == "cosine" and optim["total_steps"] == 123 and optim["min_lr_ratio"] == 0.1


def test_device_and_dtype_reach_the_learner_and_the_rollout_and_the_services_accept_them() -> None:
    from services.learner.config import LearnerSettings
    from services.rollout.config import RolloutSettings
    from services.scheduler.config import SchedulerSettings

    config = run_config(DemoSettings(), "model-dir")
    assert config["learner"]["dtype"] == config["rollout"]["dtype"] == "float32"
    assert config["learner"]["publish"]["export_dtype"] == "float32"
    assert config["scheduler"]["alignment_action"] == "fail"  # fp32: within 1e-3 or the run stops
    config = run_config(DemoSettings(device="cuda:1", dtype="bfloat16"), "model-dir")
    learner, rollout = config["learner"], config["rollout"]
    assert learner["device"] == rollout["hf"]["device"] == "cuda:1"
    assert learner["dtype"] == learner["publish"]["export_dtype"] == rollout["dtype"] == "bfloat16"
    assert config["scheduler"]["alignment_action"] == "warn"
    # every table is valid for its service's settings
    assert LearnerSettings.model_validate(learner).publish.export_dtype == "bfloat16"
    assert RolloutSettings.model_validate(rollout).hf.device == "cuda:1"
    assert SchedulerSettings.model_validate(config["scheduler"]).alignment_action == "warn"


def test_lora_versions_are_adapters_unless_merged_is_asked_for() -> None:
    """--lora-rank: the learner publishes the adapter and the rollouts serve adapters of that rank
    (vLLM's LoRA support on); --lora-sync merged: whole versions, the rollouts without LoRA."""
    for cfg, fmt, rank in [
        (DemoSettings(lora_rank=16), "adapter", 16),
        (DemoSettings(lora_rank=16, lora_sync="merged"), "full", 0),
        (DemoSettings(), "full", 0),  # a full fine-tune has no adapter
    ]:
        config = run_config(cfg, "model-dir")
        learner = LearnerSettings.model_validate(config["learner"])
        rollout = RolloutSettings.model_validate(config["rollout"])
        assert (learner.publish.export_format, rollout.vllm.max_lora_rank) == (fmt, rank)


def test_a_real_models_probe_has_the_time_a_busy_rollout_needs() -> None:
    from services.scheduler.config import SchedulerSettings

    real = SchedulerSettings.model_validate(run_config(DemoSettings(model="some/model"), "d")["scheduler"])
    tiny = SchedulerSettings.model_validate(run_config(DemoSettings(), "d")["scheduler"])
    assert real.timeouts.probe == 60.0 and tiny.timeouts.probe == SchedulerSettings().timeouts.probe
