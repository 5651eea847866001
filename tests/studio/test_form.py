"""The start form: impossible values refused with a message per field; a valid form's demo command."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.studio.form import StartForm, demo_argv, field_errors


def _errors(**values) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        StartForm.model_validate(values)
    return field_errors(caught.value)


def test_impossible_values_are_refused_field_by_field() -> None:
    errors = _errors(steps=0, group_size=1, lr=-1.0, name="../x", env="not an env", env_args=["digits"])
    assert errors["steps"] == "Input should be greater than or equal to 1"
    assert errors["group_size"] == "Input should be greater than or equal to 2"
    assert errors["lr"] == "Input should be greater than 0"
    assert "letters, digits" in errors["name"]
    assert "a built-in" in errors["env"]
    assert errors["env_args"] == "'digits': expected key=value"


def test_unknown_fields_and_an_eval_interval_beyond_the_run_are_refused() -> None:
    assert "Extra inputs are not permitted" in _errors(stepz=3)["stepz"]
    assert "more than the run's 10 steps" in _errors(steps=10, eval_every=20)["form"]


def test_cuda_ipc_needs_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert "needs an NVIDIA GPU" in _errors(transport="cuda_ipc")["transport"]


def test_a_valid_form_is_the_demo_command_line_with_unset_fields_left_to_the_demo() -> None:
    form = StartForm(model="smollm2", env="reasoning_gym:leg_counting", env_args=[" digits=3 ", ""], steps=12,
                     group_size=4, lr=1e-5, curriculum=True)  # fmt: skip
    argv = demo_argv(form, "/runs/x")
    assert argv[:2] == ["--run-dir", "/runs/x"]
    assert argv[-1] == "--curriculum"
    pairs = dict(zip(argv[:-1:2], argv[1:-1:2], strict=True))
    assert pairs["--steps"] == "12" and pairs["--model"] == "smollm2" and pairs["--lr"] == "1e-05"
    assert pairs["--env"] == "reasoning_gym:leg_counting" and pairs["--group-size"] == "4"
    assert argv.count("--env-arg") == 1 and "digits=3" in argv and "--curriculum" in argv
    assert "--groups-per-batch" not in argv and "--lora-rank" not in argv  # the demo's defaults
    tiny = demo_argv(StartForm(), "/runs/y")
    assert "--model" not in tiny and "--curriculum" not in tiny
