"""`grpo-mesh check-env`: exit 0 on a good env, 1 listing problems, 2 when it cannot load or the
command line is wrong."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.env.check import main, parse

ROOT = Path(__file__).resolve().parents[2]
LETTER = ["--env-arg", "letter=s"]


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
    assert "FAIL(exception: ValueError: empty)" in captured.out  # labelled like every failure kind
    assert "wrong answer '" in captured.err and "scored 1" in captured.err
    assert "scoring wrong answer '' failed: exception: ValueError: empty" in captured.err


def test_check_flags_are_the_recipe_fields(capsys: pytest.CaptureFixture[str]) -> None:
    brevity = f"{ROOT}/examples/my_env.py:brevity"
    args = ["arithmetic", "--n=2", "--reward-funcs", brevity, "--reward-weights", "0.1", "--seed", "3"]
    assert main([*args, "--score-timeout-seconds", "20"]) == 0
    out = capsys.readouterr().out
    assert "OK: 2 prompts" in out and "1.1" in out  # env reward 1 + 0.1 × brevity 1
    for bad, message in (
        (["--n", "0"], "grpo-mesh check-env: error: --n: Input should be greater than or equal to 1"),
        (["--reward-funcs", "answer_tags", "--reward-weights", "1,2"], "2 reward_weights for 1 reward_funcs"),
    ):
        with pytest.raises(SystemExit) as bad_exit:
            parse(["arithmetic", *bad])
        assert bad_exit.value.code == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit) as help_exit:
        main(["--help"])
    assert help_exit.value.code == 0
    help_text = capsys.readouterr().out
    for flag in (
        "SPEC",
        "-n",
        "--split",
        "--env-arg",
        "--env-args",
        "--reward-funcs",
        "--score-timeout-seconds",
    ):
        assert flag in help_text
    assert "Prompts to sample and check." in help_text  # generated from the field descriptions


def test_check_eval_split_serves_each_prompt_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["arithmetic", "--split", "eval", "--eval-size", "3", "--n", "5"]) == 0
    out = capsys.readouterr().out
    assert "OK: 3 prompts" in out and "the eval split holds 3 prompts" in out


def test_check_via_the_command_line() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services",  # = grpo-mesh check-env
            "check-env",
            "examples/my_env.py:CountLettersEnv",
            "--n",
            "2",
            *LETTER,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "OK: 2 prompts" in result.stdout
