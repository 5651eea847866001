"""`grpo-mesh prepare` (`python -m services prepare`): compose's one-shot `init` (docker-compose.yml)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.launch.prepare import PrepareSettings, parse, prepare

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services", *args],
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
    missing = _run("prepare", "--config", str(tmp_path / "absent.toml"))
    assert missing.returncode == 2 and missing.stderr.startswith("grpo-mesh prepare: error: --config: ")


def test_the_command_line_and_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["--config", "x.toml"]).config == Path("x.toml")
    with pytest.raises(SystemExit) as no_config:
        parse([])
    assert no_config.value.code == 2
    assert capsys.readouterr().err.startswith("grpo-mesh prepare: error: --config: required: The run-config")
    with pytest.raises(SystemExit) as shown:
        parse(["--help"])
    assert shown.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: grpo-mesh prepare")
    description = text.split("\n\n")[1]  # the whole docstring, not its first line cut mid-sentence
    assert description.rstrip().endswith(".") and "no model download" in " ".join(description.split())


def test_the_old_launcher_forwards_to_the_one_table() -> None:
    command = [sys.executable, "-m", "services.launch", "nonsense"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "demo" in done.stderr and "prepare" in done.stderr
