"""`python -m services.launch prepare`: compose's one-shot `init` (docker-compose.yml)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.launch.prepare import PrepareSettings, prepare

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.launch", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_run_config_without_a_prepare_table_is_a_no_op(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text('[learner]\nmodel = "Qwen/Qwen2.5-0.5B-Instruct"\n')
    done = _run("prepare", "--config", str(config))
    assert done.returncode == 0, done.stderr
    assert "nothing to prepare" in done.stderr  # logs go to stderr
    assert prepare(PrepareSettings()) is None


def test_the_tiny_model_is_built_once_where_the_table_asks(tmp_path: Path) -> None:
    out = tmp_path / "models" / "tiny"
    config = tmp_path / "run.toml"
    config.write_text(f'[prepare]\ntiny_model = "{out}"\nwarm_start_steps = 3\n')
    first = _run("prepare", "--config", str(config))
    assert first.returncode == 0, first.stderr
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "grpo_mesh_model.json").read_text())["warm_start_steps"] == 3
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    again = _run("prepare", "--config", str(config))  # `up` again: the volume already has it
    assert again.returncode == 0 and '"built": false' in again.stderr
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_bad_table_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValidationError):
        PrepareSettings.model_validate({"tiny_modle": "/data/models/tiny"})
    with pytest.raises(ValidationError):
        PrepareSettings.model_validate({"tiny_model": "/tmp/x", "warm_start_steps": -1})
    config = tmp_path / "run.toml"
    config.write_text('[prepare]\ntiny_modle = "/tmp/x"\n')
    done = _run("prepare", "--config", str(config))
    assert done.returncode == 2 and done.stderr.startswith("error: [prepare]") and "tiny_modle" in done.stderr


def test_the_launcher_names_its_commands() -> None:
    done = _run("nonsense")
    assert done.returncode != 0 and "demo,prepare" in done.stderr
