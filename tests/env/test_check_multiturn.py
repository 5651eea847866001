"""`grpo-mesh check-env` on multi-turn environments: it plays scripted episodes through `respond` and
scores their final transcripts, so a broken `respond`, a reference episode that fails, or wrong episodes
that pass are reported (exit 1), as the scheduler would meet them in training."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.env.check import main

ROOT = Path(__file__).resolve().parents[2]


def _check_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services", "check-env", *args],  # = grpo-mesh check-env
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("spec", ["tool_arithmetic", "guessing"])
def test_builtin_multiturn_envs_pass_on_the_command_line(spec: str) -> None:
    result = _check_cli(spec, "--n", "4")
    assert result.returncode == 0, result.stderr
    assert "reference episode" in result.stdout
    assert "OK: 4 prompts, 4 scripted episode sets played" in result.stdout


def test_guessing_reference_is_cut_to_max_turns(capsys: pytest.CaptureFixture[str]) -> None:
    # 1..64 needs up to 7 binary-search guesses; with 2 turns the reference jumps to the number
    assert main(["guessing", "--n", "6", "--env-arg", "high=64", "--env-arg", "max_turns=2"]) == 0


def _write(tmp_path: Path, body: str) -> str:
    path = tmp_path / "broken_envs.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_respond_that_raises_is_a_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path,
        """
        from services.env.builtins.guessing import GuessingEnv

        class Raising(GuessingEnv):
            async def respond(self, prompt, transcript):
                raise RuntimeError("no feedback today")
        """,
    )
    assert main([f"{path}:Raising", "--n", "2"]) == 1
    err = capsys.readouterr().err
    assert "respond raised at turn 1: RuntimeError: no feedback today" in err


def test_wrong_feedback_fails_the_reference_episode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path,
        """
        from services.env.base import Reply
        from services.env.builtins.guessing import GuessingEnv

        class NeverDone(GuessingEnv):  # forgets to end the game on the right number
            async def respond(self, prompt, transcript):
                return Reply(messages=[{"role": "user", "content": "Lower."}])
        """,
    )
    assert main([f"{path}:NeverDone", "--n", "2", "--env-arg", "max_turns=8"]) == 1
    err = capsys.readouterr().err
    assert "the reference episode did not end" in err


def test_wrong_episodes_that_score_are_a_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(
        tmp_path,
        """
        from services.env.builtins.tool_arithmetic import ToolArithmeticEnv

        class PaysForCalls(ToolArithmeticEnv):  # rewards the episode's tool use, not its answer
            async def score_episodes(self, prompt, transcripts):
                return [float(any(m["role"] == "tool" for m in t)) for t in transcripts]

            def score_one(self, prompt, completion):  # single-turn scoring stays right
                return super().score_one(prompt, completion)
        """,
    )
    assert main([f"{path}:PaysForCalls", "--n", "2"]) == 1
    err = capsys.readouterr().err
    assert "wrong episode '<tool_call>" in err and "scored 1 (>= success threshold 1)" in err


def test_a_failing_reference_tool_call_is_a_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(
        tmp_path,
        """
        from services.env.builtins.tool_arithmetic import ToolArithmeticEnv

        def calculator(expression: str) -> str:
            \"\"\"A calculator that is down.\"\"\"
            raise OSError("calculator offline")

        class Offline(ToolArithmeticEnv):
            def tools(self):
                return (calculator,)
        """,
    )
    assert main([f"{path}:Offline", "--n", "1"]) == 1
    err = capsys.readouterr().err
    assert "the reference episode's tool calls failed" in err and "calculator offline" in err


def test_the_env_module_checks_too_and_still_serves_by_default() -> None:
    """`python -m services.env check SPEC` is the same check; without `check` the module serves."""
    result = subprocess.run(
        [sys.executable, "-m", "services.env", "check", "examples/agent_env.py:InventoryEnv", "--n", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "2 turns, 2 tool calls" in result.stdout
    served = subprocess.run(
        [sys.executable, "-m", "services.env", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert served.returncode == 0 and "--score-workers" in served.stdout
