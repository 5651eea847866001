"""services/common/config.py: precedence CLI > env > run-config table > defaults, strictness, --help."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, ValidationError
from pydantic_settings import SettingsConfigDict

from services.common.config import ServiceSettings


class Optim(BaseModel):
    lr: float = Field(default=1e-3, description="Peak learning rate.")
    warmup: int = Field(default=0, description="Warm-up steps.")


class DemoSettings(ServiceSettings):
    """A service's settings as the services define them."""

    config_table = "cfgtest"
    model_config = SettingsConfigDict(env_prefix="GRPO_CFGTEST__")

    batch_size: int = Field(default=1, description="Prompts per optimizer step.")
    name: str = Field(default="default", description="Run name shown in logs.")
    optim: Optim = Field(default_factory=Optim, description="Optimizer settings.")
    verbose: bool = Field(default=False, description="Print more detail.")


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(
        '[cfgtest]\nbatch_size = 2\nname = "from-file"\n\n[cfgtest.optim]\nlr = 0.5\nwarmup = 7\n\n'
        "[other]\nbatch_size = 99\n"
    )
    return path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRPO_CONFIG", raising=False)
    for key in [k for k in os.environ if k.upper().startswith("GRPO_CFGTEST__")]:
        monkeypatch.delenv(key)


def test_defaults_without_any_source() -> None:
    settings = DemoSettings.from_cli([])
    assert (settings.batch_size, settings.name, settings.optim.lr, settings.port) == (1, "default", 1e-3, 0)


def test_file_table_overrides_defaults_and_other_tables_are_ignored(config_file: Path) -> None:
    settings = DemoSettings.load(config_file)
    assert (settings.batch_size, settings.name) == (2, "from-file")
    assert (settings.optim.lr, settings.optim.warmup) == (0.5, 7)
    assert settings.verbose is False


def test_env_overrides_file_field_by_field(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_CFGTEST__BATCH_SIZE", "3")
    monkeypatch.setenv("GRPO_CFGTEST__OPTIM__LR", "0.25")
    settings = DemoSettings.load(config_file)
    assert (settings.batch_size, settings.name) == (3, "from-file")
    assert (settings.optim.lr, settings.optim.warmup) == (0.25, 7)  # nested: only lr replaced


def test_cli_overrides_env_and_file(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_CFGTEST__BATCH_SIZE", "3")
    monkeypatch.setenv("GRPO_CFGTEST__NAME", "from-env")
    argv = ["--config", str(config_file), "--batch-size", "4", "--optim.lr", "0.125", "--verbose"]
    settings = DemoSettings.from_cli(argv)
    assert (settings.batch_size, settings.name, settings.verbose) == (4, "from-env", True)
    assert (settings.optim.lr, settings.optim.warmup) == (0.125, 7)


def test_config_file_from_grpo_config_env(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_CONFIG", str(config_file))
    assert DemoSettings.from_cli([]).batch_size == 2


def test_unknown_field_in_file_table_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[cfgtest]\nbatch_sise = 2\n")
    with pytest.raises(ValidationError, match="batch_sise"):
        DemoSettings.load(path)


def test_unknown_env_variable_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_CFGTEST__BATCH_SISE", "2")
    with pytest.raises(ValueError, match="GRPO_CFGTEST__BATCH_SISE"):
        DemoSettings.load()


def test_unknown_keyword_and_flag_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValidationError, match="batch_sise"):
        DemoSettings.load(batch_sise=2)
    with pytest.raises(SystemExit) as exit_info:
        DemoSettings.from_cli(["--batch-sise", "2"])
    assert exit_info.value.code == 2
    assert "--batch-sise" in capsys.readouterr().err


def test_invalid_value_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRPO_CFGTEST__BATCH_SIZE", "many")
    with pytest.raises(ValidationError, match="batch_size"):
        DemoSettings.load()


def test_help_lists_every_field_with_its_description(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        DemoSettings.from_cli(["--help"], prog="python -m services.demo")
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "python -m services.demo" in text
    for flag, description in [
        ("--batch-size", "Prompts per optimizer step."),
        ("--optim.lr", "Peak learning rate."),
        ("--port-file", "Write the bound port to this file"),
        ("--grace-seconds", "On SIGTERM, in-flight RPCs get this long to finish."),
    ]:
        assert flag in text
        assert description in text
