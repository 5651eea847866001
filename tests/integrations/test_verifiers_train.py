"""A verifiers (0.4.0) environment, unmodified, trains on grpo-mesh: `grpo-mesh demo --harness` starts
learner, rollout (vLLM), scheduler (source external) and the gateway, then the verifiers runner in its own
virtualenv (`.venvs/verifiers`) with `examples/verifiers_env.py`; the runner's rollouts go through the
gateway's token route (verifiers' train client) and its scored groups through the trajectory API.

The harness runs with no network: every proxy points at a closed port (loopback excepted) and uv gets an
empty cache of its own, so verifiers' uv-script bootstrap must come from the venv's wheels
(scripts/venv_verifiers.sh). Checks: the run finishes, versions advance by one per step, every measured
probe is within 1e-4, the audit passes, the runner's groups were accepted, and the gateway refused none.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.runs import audit, kill_what_is_left, rows

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venvs" / "verifiers" / "bin" / "python"
STEPS = 20
B = 1
G = 4  # half the demo's 8: a rollout is a harness program (~1.5 s of this CPU), the group its wall time
RUN_LIMIT_S = 900  # a hard bound: the test can never hang CI
DEAD = "http://127.0.0.1:9"  # nothing listens: any request that leaves the machine fails

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(RUN_LIMIT_S + 180),  # above the run's own bound (pyproject's default is 600 s)
    pytest.mark.skipif(
        not VENV_PYTHON.exists(), reason=".venvs/verifiers is missing: run scripts/venv_verifiers.sh"
    ),
]


def harness(uv_cache: Path) -> str:
    offline = (
        f"env HTTP_PROXY={DEAD} HTTPS_PROXY={DEAD} ALL_PROXY={DEAD} NO_PROXY=127.0.0.1,localhost "
        f"HF_HUB_OFFLINE=1 UV_CACHE_DIR={uv_cache}"
    )
    return (
        f"{offline} {VENV_PYTHON} -m integrations.verifiers.run "
        "--env examples/verifiers_env.py:load_environment --env-arg operators=+- --gateway {gateway} "
        "--model {model} --group-size {group_size} --steps {steps} --max-tokens {max_tokens} "
        "--temperature {temperature} --seed {seed} --raw-prompt --concurrency {group_size}"
    )


def test_a_verifiers_env_trains_through_the_gateway(tmp_path: Path, warm_model_dir: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "services", "demo", "--run-dir", str(run_dir), "--model", str(warm_model_dir),
        "--engine", "vllm", "--steps", str(STEPS), "--groups-per-batch", str(B), "--group-size", str(G),
        "--eval-every", "0",
        "--harness", harness(tmp_path / "uv-cache"),
    ]  # fmt: skip
    log = tmp_path / "launcher.log"
    with log.open("w") as out:
        launcher = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        returncode = launcher.wait(timeout=RUN_LIMIT_S)
    finally:
        kill_what_is_left(launcher, set())  # its process group, by pid, if it is still running
    harness_log = (run_dir / "logs" / "harness.log").read_text() if (run_dir / "logs").exists() else ""
    assert returncode == 0, log.read_text()[-3000:] + harness_log[-3000:]

    steps = [r for r in rows(run_dir) if "reward_mean" in r]
    assert [r["weight_version"] for r in steps] == list(range(1, STEPS + 1))
    measured = [r["logprob_abs_diff_max"] for r in steps if r.get("logprob_abs_diff_max") is not None]
    assert measured and max(measured) <= 1e-4, measured
    _, counts = audit(run_dir)
    assert counts["steps"] == STEPS and counts["groups_trained"] == STEPS * B, counts

    # the runner's group lines (stderr, in the harness log): the groups it submitted were accepted; no
    # rollout was refused as not token-exact (a run's end may cut its last group's calls short)
    events = [json.loads(line) for line in harness_log.splitlines() if line.startswith('{"t"')]
    answers = [e["answer"] for e in events if e["event"] == "group"]
    assert sum(a.get("accepted", 0) for a in answers) >= STEPS * B, answers[-5:]
    assert not [e for e in events if e["event"] == "rollout refused" and e["kind"] != "failed"], events[-5:]
    # the launcher stopped the runner (SIGTERM, with the gateway stopping at once): it printed its summary
    assert [line for line in harness_log.splitlines() if line.startswith('{"rollouts"')], harness_log[-2000:]
    gateway_log = (run_dir / "logs" / "gateway.log").read_text()
    assert "scored data refused" not in gateway_log
    rewards = [r["reward_mean"] for r in steps]
    print(f"reward first 5 {sum(rewards[:5]) / 5:.3f}, last 5 {sum(rewards[-5:]) / 5:.3f}")
