"""`python -m services.env check`: exit 0 on a good env, 1 listing problems, 2 when it cannot load."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.env.check import main

ROOT = Path(__file__).resolve().parents[2]


def test_check_builtin_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["arithmetic", "--n", "3", "--env-arg", "digits=3"]) == 0
    out = capsys.readouterr().out
    assert "ref reward" in out and "OK: 3 prompts" in out


def test_check_example_env_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([f"{ROOT}/examples/my_env.py:CountLettersEnv", "--n", "2", "--split", "eval"]) == 0


def test_check_bad_options_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["arithmetic", "--env-arg", "digits=0"]) == 2
    err = capsys.readouterr().err
    assert "digits: Input should be greater than or equal to 1" in err


def test_check_reports_a_broken_scorer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env_file = tmp_path / "lenient.py"
    env_file.write_text(
        textwrap.dedent(
            """
            from services.env.builtins.arithmetic import ArithmeticEnv

            class Lenient(ArithmeticEnv):
                def score_one(self, prompt, completion):
                    if completion == "":
                        raise ValueError("empty")
                    return 1.0  # everything is right: wrong answers must be caught
            """
        )
    )
    assert main([f"{env_file}:Lenient", "--n", "2"]) == 1
    captured = capsys.readouterr()
    assert "PROBLEM" in captured.out
    assert "wrong answer '" in captured.err and "scored 1" in captured.err
    assert "failed: exception: ValueError: empty" in captured.err or "ValueError: empty" in captured.err


def test_check_via_module_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.env", "check", "arithmetic", "--n", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "OK: 2 prompts" in result.stdout
