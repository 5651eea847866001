"""docker-compose.yml checked against the code, statically (tests/e2e/test_compose_up.py runs it where a
Docker daemon answers).

Per profile (cpu, gpu, gpu-nccl) each role runs once, after the one-shot `init`; commands name real
service modules with the documented ports, published on 127.0.0.1; healthchecks probe the same port
for the role's full gRPC service name (and the stub really works against a live server); the scheduler
waits for the others to be healthy; every GRPO_* variable names a settings field and, with every
run-config in docker/configs/, validates; peer addresses point at real services (the settings helpers
are shared with tests/test_k8s.py: tests/deployment_settings.py). The learner runs under torchrun as
GRPO_LEARNER_RANKS ranks: its options are read with torch's own parser and run at 2 ranks.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import grpc
import pytest
import yaml
from deployment_settings import field_path_error, health_service_name, settings_class

from services.common.config import ServiceSettings
from services.common.serve import start_server

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
ROLES = sorted(n for n in SERVICES if n != "init")  # the compose services that run a gRPC service
RUN_CONFIGS = sorted(p.name for p in (ROOT / "docker" / "configs").glob("*.toml"))
INTERPOLATION = re.compile(r"\$\{([A-Z_]+):-([^}]*)\}")
PORTS = {"scheduler": 50050, "env": 50051, "rollout": 50052, "learner": 50053}  # documented defaults
PROFILES = ("cpu", "gpu", "gpu-nccl")
ADDRESS = re.compile(r"^([a-z][a-z0-9-]*):(\d+)$")
TORCHRUN = "services.launch.torchrun"  # torchrun with a clean stop (its options are torchrun's)


def _launch(name: str) -> tuple[list[str], str, list[str]]:
    """A service's command as (torchrun's options, [] when it runs without torchrun; the module; the
    module's arguments)."""
    command = SERVICES[name]["command"]
    assert command[:2] == ["python", "-m"], command
    if command[2] == TORCHRUN:
        at = command.index("-m", 3)
        launcher, rest = command[3:at], command[at + 1 :]
    else:
        launcher, rest = [], command[2:]
    assert rest[0] == "services" or rest[0].startswith("services."), command
    return launcher, rest[0], rest[1:]


def _role(name: str) -> str:
    return _launch(name)[1].removeprefix("services.")


def _expand(value: str, **chosen: str) -> str:
    """Compose's `${VAR:-default}`, with `chosen` standing in for the host's variables."""
    return INTERPOLATION.sub(lambda m: chosen.get(m.group(1), m.group(2)), value)


def _flag(name: str, flag: str, **chosen: str) -> str:
    """The value of one of the service's own flags (not torchrun's)."""
    command = _launch(name)[2]
    assert command.count(flag) == 1, f"{name}: {flag} must appear once in {command}"
    return _expand(command[command.index(flag) + 1], **chosen)


def _active(profile: str) -> dict[str, str]:
    """role -> compose service for the services a profile starts."""
    return {_role(n): n for n in ROLES if profile in SERVICES[n].get("profiles", [profile])}


def _mounts(name: str) -> dict[str, str]:
    """container path -> source (named volume or host path relative to the repo)."""
    return {m.split(":")[1]: m.split(":")[0] for m in SERVICES[name]["volumes"]}


def _run_config(name: str, config_file: str = "default.toml") -> Path:
    """The host file mounted where the service's --config points (GRPO_MESH_CONFIG=config_file)."""
    config = Path(_flag(name, "--config", GRPO_MESH_CONFIG=config_file))
    mounted = {Path(target): source for target, source in _mounts(name).items()}
    for target, source in mounted.items():
        if config == target or target in config.parents:
            return ROOT / source / config.relative_to(target)
    raise AssertionError(f"{name}: --config {config} is not mounted")


def _stub(name: str) -> str:
    test = SERVICES[name]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and len(test) == 4, test
    return test[3]


@pytest.mark.parametrize("profile", PROFILES)
def test_each_profile_runs_every_role_once(profile: str) -> None:
    roles = [_role(n) for n in ROLES if profile in SERVICES[n].get("profiles", [profile])]
    assert sorted(roles) == sorted(PORTS), f"profile {profile}: {roles}"


@pytest.mark.parametrize("name", ROLES)
def test_command_port_and_healthcheck_agree(name: str) -> None:
    role, service = _role(name), SERVICES[name]
    port = int(_flag(name, "--port"))
    assert port == PORTS[role]
    published = [_expand(str(p)).split(":")[-1] for p in service.get("ports", [])] + [
        str(p) for p in service.get("expose", [])
    ]
    assert str(port) in published, f"{name}: port {port} neither exposed nor published"
    host_ports = [_expand(str(p)) for p in service.get("ports", [])]
    assert f"127.0.0.1:{port}:{port}" in host_ports, f"{name}: {port} not published on 127.0.0.1 for grpcurl"
    stub = _stub(name)
    assert re.findall(r"127\.0\.0\.1:(\d+)", stub) == [str(port)], stub
    assert re.findall(r'service="([^"]+)"', stub) == [health_service_name(role)], stub
    settings_class(role)  # skips while services/<role>/ is being written
    assert (ROOT / "services" / role / "__main__.py").exists(), f"python -m services.{role} has no __main__"


@pytest.mark.parametrize("profile", PROFILES)
def test_scheduler_waits_for_the_others_to_be_healthy(profile: str) -> None:
    active = _active(profile)
    depends = SERVICES[active["scheduler"]].get("depends_on", {})
    expected = {active[r] for r in ("env", "rollout", "learner")}
    assert set(depends) == expected
    assert all(d.get("condition") == "service_healthy" for d in depends.values()), depends
    assert "depends_on" not in SERVICES[active["env"]]
    for role in ("rollout", "learner"):  # they load the model: after `init` has prepared it
        after_init = {"init": {"condition": "service_completed_successfully"}}
        assert SERVICES[active[role]]["depends_on"] == after_init


@pytest.mark.parametrize("profile", PROFILES)
def test_init_prepares_what_the_run_config_asks_and_runs_once(profile: str) -> None:
    init = SERVICES["init"]
    assert profile in init["profiles"] and init["restart"] == "no"
    assert init["command"][:4] == ["python", "-m", "services", "prepare"]  # the image has no console script
    assert _flag("init", "--config") == _flag(_active(profile)["scheduler"], "--config")


@pytest.mark.parametrize("config_file", RUN_CONFIGS)
def test_every_run_config_prepares_and_serves_one_model(config_file: str) -> None:
    from services.launch.prepare import PrepareSettings

    config = tomllib.loads(_run_config("init", config_file).read_text())
    prepare = PrepareSettings.model_validate(config.get("prepare", {}))
    assert config["learner"]["model"] == config["rollout"]["model"]
    if prepare.tiny_model is not None:  # a model built into the volume: the one both services load
        assert str(prepare.tiny_model).startswith("/data/") and config["learner"]["model"] == str(
            prepare.tiny_model
        )


def test_no_healthcheck_option_that_older_engines_refuse() -> None:
    """Engines before v25 (Debian bookworm's docker.io 20.10) reject start_interval outright."""
    for name, service in SERVICES.items():
        assert "start_interval" not in service.get("healthcheck", {}), name


def test_images_build_from_a_base_argument_as_a_non_root_user() -> None:
    cpu = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim" in cpu and cpu.count("FROM ${BASE_IMAGE}") == 2
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (ROOT / "docker" / dockerfile).read_text()
        users = re.findall(r"^USER (\S+)", text, re.M)
        assert users and users[-1] not in ("root", "0"), dockerfile
    build = SERVICES["scheduler"]["build"]
    assert _expand(build["args"]["BASE_IMAGE"]) == "python:3.11-slim"  # what users with a registry get
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "runs", ".cache"} <= set(ignored)


@pytest.mark.parametrize("name", sorted(SERVICES))
@pytest.mark.parametrize("config_file", RUN_CONFIGS)
def test_volumes_shared_data_and_run_config(name: str, config_file: str) -> None:
    assert _mounts(name).get("/data") == "grpo-data" and "grpo-data" in COMPOSE["volumes"]
    assert _run_config(name, config_file).is_file()


@pytest.mark.parametrize("name", ROLES)
@pytest.mark.parametrize("config_file", RUN_CONFIGS)
def test_a_crashed_service_is_restarted_and_its_state_is_on_the_volume(name: str, config_file: str) -> None:
    """restart: on-failure brings a killed container back; the scheduler's ledger and the learner's
    checkpoints live under /data (the named volume), and the learner resumes from them."""
    assert SERVICES[name]["restart"] == "on-failure"
    config = tomllib.loads(_run_config(name, config_file).read_text())
    assert config["scheduler"]["run_dir"].startswith("/data/")
    checkpoint = config["learner"]["checkpoint"]
    assert checkpoint["dir"].startswith("/data/") and checkpoint["resume"] and checkpoint["every"] > 0


def test_gpu_pair_shares_gpu_ipc_and_pid() -> None:
    active = _active("gpu")
    pair = [SERVICES[active[r]] for r in ("rollout", "learner")]
    devices = [s["deploy"]["resources"]["reservations"]["devices"] for s in pair]
    assert devices[0] == devices[1], "rollout and learner must reserve the same GPU(s)"
    assert all(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices[0])
    assert all(s["ipc"] == "host" and s["pid"] == "host" for s in pair)
    assert all(s["build"]["dockerfile"] == "docker/Dockerfile.gpu" for s in pair)
    for role in ("rollout", "learner"):
        if active[role] != role:  # peers address the role name: the variant must answer to it
            assert role in SERVICES[active[role]]["networks"]["default"]["aliases"]


def test_nccl_layout_puts_learner_and_rollout_on_different_gpus_with_a_fixed_rendezvous() -> None:
    active = _active("gpu-nccl")
    learner, rollout, scheduler = (SERVICES[active[r]] for r in ("learner", "rollout", "scheduler"))
    ids = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in (learner, rollout)]
    assert ids[0] != ids[1], "NCCL cannot place two ranks on one GPU"
    port = learner["environment"]["GRPO_LEARNER__PUBLISH__COLLECTIVE_PORT"]
    assert port in learner["expose"]
    assert learner["environment"]["NCCL_SOCKET_IFNAME"] == rollout["environment"]["NCCL_SOCKET_IFNAME"]
    assert scheduler["environment"]["GRPO_SCHEDULER__WEIGHT_TRANSPORT"] == "nccl"
    assert (
        SERVICES[_active("gpu")["scheduler"]]["environment"]["GRPO_SCHEDULER__WEIGHT_TRANSPORT"] == "cuda_ipc"
    )


def test_cpu_rollout_shares_the_learners_shared_memory() -> None:
    """Learner and rollout mount one tmpfs volume at /dev/shm, which outlives a restart of either (with
    `ipc: service:learner`, a learner restarted by `restart:` got a fresh /dev/shm the rollout did not
    see, and every weight sync after that failed)."""
    active = _active("cpu")
    shm = set()
    for role in ("learner", "rollout"):
        service = SERVICES[active[role]]
        assert "ipc" not in service, f"{role}: a joined IPC namespace does not survive a learner restart"
        mounts = {m.split(":")[1]: m.split(":")[0] for m in service["volumes"]}  # target -> source
        assert "/dev/shm" in mounts, f"{role}: no shared /dev/shm"
        assert "/data" in mounts and "/app/configs" in mounts, f"{role}: its volumes replace the shared ones"
        shm.add(mounts["/dev/shm"])
    assert len(shm) == 1, "learner and rollout must mount the same /dev/shm volume"
    options = COMPOSE["volumes"][shm.pop()]["driver_opts"]
    assert options["type"] == "tmpfs" and "size=" in options["o"]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_dockerfiles_exist(name: str) -> None:
    assert (ROOT / SERVICES[name]["build"]["dockerfile"]).is_file()


@pytest.mark.parametrize("name", ROLES)
@pytest.mark.parametrize("config_file", RUN_CONFIGS)
def test_env_vars_name_settings_fields_and_validate(
    name: str, config_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    role = _role(name)
    settings_cls = settings_class(role)
    prefix = f"GRPO_{role.upper()}__"
    assert settings_cls.model_config.get("env_prefix") == prefix
    environment = {k: str(v) for k, v in SERVICES[name].get("environment", {}).items()}
    grpo_vars = {k: v for k, v in environment.items() if k.startswith("GRPO_")}
    for key in grpo_vars:
        assert key.startswith(prefix), f"{name}: {key} is not for {role} ({prefix}*)"
        error = field_path_error(settings_cls, key.removeprefix(prefix).lower().split("__"))
        assert error is None, f"{name}: {key}: {error}"
    for key in [k for k in os.environ if k.startswith("GRPO_")]:
        monkeypatch.delenv(key)
    for key, value in grpo_vars.items():
        monkeypatch.setenv(key, value)
    settings = settings_cls.load(_run_config(name, config_file), port=int(_flag(name, "--port")))
    assert settings.host == "0.0.0.0", f"{name}: must bind all interfaces inside its container"


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_peer_addresses_point_at_services_of_the_same_profiles(name: str) -> None:
    for key, value in SERVICES[name].get("environment", {}).items():
        for address in re.findall(r"[a-z][a-z0-9-]*:\d+", str(value)):
            host, port = ADDRESS.match(address).groups()
            for profile in SERVICES[name].get("profiles", PROFILES):
                active = _active(profile)
                assert host in active, f"{name}: {key}={value}: no role {host!r} in profile {profile}"
                assert int(port) == PORTS[host], f"{name}: {key}={value}: {host} listens on {PORTS[host]}"


class _NamedApp:
    """Serves nothing but health, under one service name."""

    def __init__(self, service_name: str) -> None:
        self.service_names = (service_name,)

    def register(self, server: grpc.aio.Server) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


async def _run_stub(name: str, ready: bool) -> int:
    role = _role(name)
    app = _NamedApp(health_service_name(role))
    running = await start_server(app, ServiceSettings(port=0, grace_seconds=0.1))
    try:
        if not ready:
            await running.set_ready(False)
        stub = _stub(name).replace(f"127.0.0.1:{PORTS[role]}", running.address)
        process = await asyncio.create_subprocess_exec(sys.executable, "-c", stub)
        return await asyncio.wait_for(process.wait(), 60)
    finally:
        await running.close()


@pytest.mark.parametrize("role", sorted(PORTS))
async def test_healthcheck_stub_probes_readiness_of_a_live_server(role: str) -> None:
    name = _active("cpu")[role]
    assert await _run_stub(name, ready=True) == 0
    if role == "learner":
        assert await _run_stub(name, ready=False) != 0


def test_stub_is_three_lines() -> None:
    for name in ROLES:
        assert len(_stub(name).strip().splitlines()) == 3, name


def test_learner_and_rollout_serve_the_same_model() -> None:
    config = tomllib.loads(_run_config("learner").read_text())
    assert config["learner"]["model"] == config["rollout"]["model"]


@pytest.mark.parametrize("role", sorted(PORTS))
def test_command_module_runs_and_accepts_the_flags(role: str) -> None:
    """The module's --help lists every flag the command passes; the learner's is run the way compose
    runs it, under torchrun with its options, at 2 ranks (each rank prints the help and exits 0)."""
    settings_class(role)
    (name,) = {n for n in ROLES if _role(n) == role and "cpu" in SERVICES[n].get("profiles", ["cpu"])}
    launcher, module, args = _launch(name)
    launcher = [_expand(a, GRPO_LEARNER_RANKS="2") for a in launcher]
    command = [sys.executable, *(["-m", TORCHRUN, *launcher] if launcher else []), "-m", module, "--help"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for flag in args[::2]:
        assert flag in done.stdout, f"{name}: {flag} missing from --help"
    if launcher:
        assert done.stdout.count("usage: python -m services.learner") == 2, "torchrun did not start 2 ranks"


def _stop_grace_s(name: str) -> float:
    grace = SERVICES[name]["stop_grace_period"]
    assert re.fullmatch(r"\d+s", grace), grace
    return float(grace[:-1])


@pytest.mark.parametrize("ranks", [None, "1", "2"])
@pytest.mark.parametrize("profile", PROFILES)
def test_learner_runs_as_ranks_under_torchrun(profile: str, ranks: str | None) -> None:
    """Every learner variant starts as GRPO_LEARNER_RANKS ranks (default 1) under torchrun, read by
    torch's own parser: a rendezvous of its own (one container), no restarts of its own (compose's
    `restart:` restarts the learner as a whole), the same launch as the demo's --learner-ranks
    (services/launch/demo.py), and a shutdown deadline between the learner's grace and compose's."""
    from torch.distributed.run import get_args_parser

    from services.launch.demo import DemoSettings, learner_runner

    name = _active(profile)["learner"]
    launcher, module, args = _launch(name)
    assert launcher, f"{name}: the learner must run under torchrun"
    chosen = {} if ranks is None else {"GRPO_LEARNER_RANKS": ranks}
    command = [*launcher, "-m", module, *args]
    options = get_args_parser().parse_args([_expand(a, **chosen) for a in command])
    assert options.nproc_per_node == (ranks or "1")
    assert options.standalone and options.max_restarts == 0
    assert options.module and options.training_script == "services.learner"
    assert options.training_script_args == [_expand(a) for a in args]
    settings = settings_class("learner")
    grace = settings.model_fields["grace_seconds"].default
    assert grace < options.shutdown_timeout < _stop_grace_s(name), "rank 0 needs its grace, then torchrun's"
    assert SERVICES[name]["init"] is True, "tini (init: true) passes SIGTERM on to torchrun"
    assert SERVICES[name]["restart"] == "on-failure"
    demo = learner_runner(DemoSettings(learner_ranks=2))
    demo_options = get_args_parser().parse_args([*demo[demo.index(TORCHRUN) + 1 :], "services.learner"])
    for option in ("standalone", "max_restarts", "module"):
        assert getattr(options, option) == getattr(demo_options, option), option


def test_learner_ranks_default_to_one_everywhere() -> None:
    """One variable sets the ranks of every learner variant; unset, the learner is one rank as before."""
    for name in ROLES:
        launcher, _, _ = _launch(name)
        found = INTERPOLATION.findall(" ".join(launcher))
        assert found == ([("GRPO_LEARNER_RANKS", "1")] if _role(name) == "learner" else []), (name, found)


@pytest.mark.parametrize("profile", PROFILES)
def test_docker_compose_itself_accepts_every_profile(profile: str) -> None:
    """Compose v2's own parser and validation (`docker compose config`; needs no daemon), where
    installed: the GPU profiles are checked this way only, no GPU runs them here."""
    try:
        version = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        version = None
    if version is None or version.returncode != 0:
        pytest.skip("Docker Compose v2 is not installed (README 'Docker Compose' says how to get it)")
    for config_file in RUN_CONFIGS:
        done = subprocess.run(
            ["docker", "compose", "--profile", profile, "config", "--quiet"],
            cwd=ROOT, env={**os.environ, "GRPO_MESH_CONFIG": config_file},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
