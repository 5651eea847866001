"""`docker compose up`, for real, on this machine (`make compose-test`): the CPU profile with the tiny
model (docker/configs/tiny.toml), under its own project name and free host ports.

Builds the image (base image and wheelhouse chosen by scripts/compose-up.sh --prepare-only), starts
everything and waits for the four containers to be healthy (the one-shot `init` first), then from the
host: grpcurl lists, describes and health-checks every published port; waits for training steps in
`metrics.jsonl` read from the named volume; `stop` must end every container with exit code 0 after a
logged drain; `up` again must resume the run (the learner from its checkpoint, the scheduler from its
ledger) and the ledger's exactly-once audit must pass across the restart. Containers, network and
volume are removed at the end, pass or fail.

Skipped, saying why, where no Docker daemon or Compose v2 answers (CI has neither: see README
"Docker Compose" for why CI does not run it).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"scheduler": 50050, "env": 50051, "rollout": 50052, "learner": 50053}
SERVICE_NAMES = {
    "scheduler": "grpo.scheduler.v1.SchedulerService",
    "env": "grpo.env.v1.EnvironmentService",
    "rollout": "grpo.rollout.v1.RolloutService",
    "learner": "grpo.learner.v1.LearnerService",
}
RUN_DIR = "/data/runs/tiny"
FIRST_STEPS, MORE_STEPS = 5, 3


def _answers(*command: str) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Compose:
    """`docker compose` under one project name, with the test's environment."""

    def __init__(self) -> None:
        self.project = f"grpo-mesh-test-{uuid.uuid4().hex[:8]}"
        self.ports = {role: _free_port() for role in ROLES}
        self.env = {
            **os.environ,
            "GRPO_MESH_CONFIG": "tiny.toml",
            **{f"GRPO_PORT_{role.upper()}": str(port) for role, port in self.ports.items()},
        }

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        command = ["docker", "compose", "-p", self.project, "--profile", "cpu", *args]
        done = subprocess.run(
            command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"{' '.join(command)} -> {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done

    def on_volume(self, *command: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """`command` in a throwaway container of the image with the project's data volume: readable
        whether the services run or not."""
        volume = f"{self.project}_grpo-data:/data"
        return subprocess.run(
            ["docker", "run", "--rm", "-v", volume, "grpo-mesh:cpu", *command],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def metrics(self) -> list[dict]:
        done = self.on_volume("cat", f"{RUN_DIR}/metrics.jsonl")
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]

    def steps(self) -> list[int]:
        return [row["weight_version"] for row in self.metrics() if "reward_mean" in row]

    def wait_for_steps(self, at_least: int, timeout: float = 600) -> list[int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = self.steps()
            if steps and max(steps) >= at_least:
                return steps
            time.sleep(2)
        raise AssertionError(
            f"no step {at_least} within {timeout:g}s; logs:\n{self.run('logs', check=False).stdout[-4000:]}"
        )

    def exit_codes(self) -> dict[str, tuple[str, int]]:
        done = self.run("ps", "-a", "--format", "json")
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        return {row["Service"]: (row["State"], row["ExitCode"]) for row in rows}


@pytest.fixture
def compose():
    if not shutil.which("docker") or not _answers("docker", "info"):
        pytest.skip("no Docker daemon answers (`docker info` fails): the compose run needs one")
    if not _answers("docker", "compose", "version"):
        pytest.skip("Docker Compose v2 (`docker compose`) is not installed: README 'Docker Compose' says how")
    prepared = subprocess.run(
        ["bash", "scripts/compose-up.sh", "--prepare-only"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    base = next(line for line in prepared.stdout.splitlines() if "base image" in line).split()[-1]
    project = Compose()
    project.env["GRPO_BASE_IMAGE"] = base
    try:
        yield project
    finally:
        project.run("down", "--volumes", "--remove-orphans", "--timeout", "30", check=False, timeout=300)


def _grpcurl(*args: str) -> str:
    binary = Path(sys.executable).parent / "grpcurl"
    done = subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"grpcurl {' '.join(args)}: {done.stderr}"
    return done.stdout


def test_compose_builds_runs_inspects_stops_gracefully_and_resumes(compose: Compose) -> None:
    compose.run("build", timeout=1200)
    compose.run("up", "-d", "--wait", "--wait-timeout", "600", timeout=900)
    states = compose.exit_codes()
    assert states["init"] == ("exited", 0), states
    assert all(states[role][0] == "running" for role in ROLES), states

    for role, port in compose.ports.items():  # what the README tells a user to type
        address = f"127.0.0.1:{port}"
        listed = _grpcurl("-plaintext", address, "list").split()
        assert SERVICE_NAMES[role] in listed and "grpc.health.v1.Health" in listed, listed
        assert f"service {SERVICE_NAMES[role].rsplit('.', 1)[1]}" in _grpcurl(
            "-plaintext", address, "describe", SERVICE_NAMES[role]
        )
        health = _grpcurl("-plaintext", "-d", json.dumps({"service": SERVICE_NAMES[role]}), address,
                          "grpc.health.v1.Health/Check")  # fmt: skip
        assert json.loads(health)["status"] == "SERVING"

    first = compose.wait_for_steps(FIRST_STEPS)
    assert first == list(range(1, len(first) + 1)), first

    compose.run("stop", "--timeout", "60", timeout=300)  # what `down` does before removing
    states = compose.exit_codes()
    assert all(states[name] == ("exited", 0) for name in states), states
    logs = [json.loads(line.split("|", 1)[1]) for line in compose.run("logs").stdout.splitlines()
            if "|" in line and line.split("|", 1)[1].strip().startswith("{")]  # fmt: skip
    for role in ROLES:
        events = [r["event"] for r in logs if r.get("service") == role]
        assert "draining" in events and events.index("draining") < len(events) - events[::-1].index(
            "stopped"
        ), role
    stopped_at = max(compose.steps())

    compose.run("up", "-d", "--wait", "--wait-timeout", "600", timeout=900)
    steps = compose.wait_for_steps(stopped_at + MORE_STEPS)
    assert steps == list(range(1, len(steps) + 1)), steps  # resumed: no version skipped or repeated
    compose.run("stop", "--timeout", "60", timeout=300)
    audit = compose.on_volume("python", "-m", "services", "audit", RUN_DIR)  # the image: no console script
    assert audit.returncode == 0, audit.stdout[-3000:]
    assert "scheduler_starts" in audit.stdout
