"""deploy/k8s/ checked against the code, since no cluster runs here (the manifests are never applied).

Every manifest validates (strict) against Kubernetes' OpenAPI schemas with kubernetes-validate, offline;
kustomization.yaml lists them all. Per role: one ClusterIP Service with a `grpc` port, the workload
kind, the command with the documented port, container port = Service targetPort, gRPC probes naming the
role's full service name, images, GPUs, security context, the run-config and PVC mounts. Every GRPO_*
variable names a settings field and, with the ConfigMap's run-config, validates; peer addresses point at
Services that exist; each rollout replica registers itself at its pod's address.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from deployment_settings import field_path_error, health_service_name, settings_class

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
KUSTOMIZATION = "kustomization.yaml"
MANIFESTS = sorted(p.name for p in K8S.glob("*.yaml") if p.name != KUSTOMIZATION)
DOCS: list[tuple[str, dict]] = [
    (name, doc) for name in MANIFESTS for doc in yaml.safe_load_all((K8S / name).read_text()) if doc
]
PORTS = {"scheduler": 50050, "env": 50051, "rollout": 50052, "learner": 50053}  # documented defaults
WORKLOAD_KINDS = {
    "learner": "StatefulSet",
    "scheduler": "StatefulSet",
    "env": "Deployment",
    "rollout": "Deployment",
}
GPU_ROLES = {"learner", "rollout"}
# The oldest and newest Kubernetes schemas kubernetes-validate ships (grpc probes are GA since 1.27).
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
CONFIG_DIR, RUN_CONFIG, DATA = "/app/configs", "run.toml", "/data"
COLLECTIVE_PORT = 29500
UID = 10001  # the images' user (docker/Dockerfile.*)
ADDRESS = re.compile(r"\b([a-z][a-z0-9-]*):(\d+)\b")
# Plausible values for downward-API fields (what the kubelet would put there).
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"  # a StatefulSet pod's ordinal
DOWNWARD = {"metadata.name": "rollout-5f7c9d8b6-x2x7q", "status.podIP": "10.244.1.17", POD_INDEX: "0"}
TORCHRUN = "services.launch.torchrun"  # the learner: torchrun with a clean stop, `... -m services.learner`
LEARNER_PROBE = "learner-probe.py"  # the learner's probe script, a ConfigMap key


def _objects(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


def _workload(role: str) -> dict:
    found = [
        d for _, d in DOCS if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == role
    ]
    assert len(found) == 1, f"one workload named {role!r} expected, found {len(found)}"
    return found[0]


def _pod(role: str) -> dict:
    return _workload(role)["spec"]["template"]["spec"]


def _container(role: str) -> dict:
    (container,) = [c for c in _pod(role)["containers"] if c["name"] == role]
    return container


def _service(role: str) -> dict:
    services = _objects("Service")
    assert role in services, f"no Service named {role!r}"
    return services[role]


def _named_port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == name]
    return port


def _launch(command: list[str]) -> tuple[list[str], str, list[str]]:
    """(torchrun's options, [] without torchrun; the module; the module's arguments)."""
    assert command[:2] == ["python", "-m"], command
    if command[2] == TORCHRUN:
        at = command.index("-m", 3)
        return command[3:at], command[at + 1], command[at + 2 :]
    return [], command[2], command[3:]


def _headless(role: str) -> dict:
    """The headless Service that governs a StatefulSet's pods (their DNS names)."""
    name = _workload(role)["spec"]["serviceName"]
    return _objects("Service")[name]


def _expanded(container: dict) -> list[str]:
    """The container's command as the kubelet runs it: $(VAR) from its environment."""
    environment = _environment(container)
    return [re.sub(r"\$\((\w+)\)", lambda m: environment[m[1]], a) for a in container["command"]]


def _flag(command: list[str], flag: str) -> str:
    assert command.count(flag) == 1, f"{flag} must appear once in {command}"
    return command[command.index(flag) + 1]


def _environment(container: dict) -> dict[str, str]:
    """The container's variables as the kubelet sets them: downward-API fields filled, $(VAR) expanded."""
    values: dict[str, str] = {}
    for var in container.get("env", []):
        if "valueFrom" in var:
            values[var["name"]] = DOWNWARD[var["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            value = str(var["value"])
            values[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), value)
    return values


def _run_config_text() -> str:
    (configmap,) = [d for _, d in DOCS if d["kind"] == "ConfigMap"]
    return configmap["data"][RUN_CONFIG]


def _run_config() -> dict:
    return tomllib.loads(_run_config_text())


@pytest.fixture
def run_config_file(tmp_path: Path) -> Path:
    path = tmp_path / RUN_CONFIG
    path.write_text(_run_config_text())
    return path


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for key in [k for k in os.environ if k.startswith("GRPO_")]:
        monkeypatch.delenv(key)
    return monkeypatch


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_validate_strictly(name: str, version: str) -> None:
    docs = [d for n, d in DOCS if n == name]
    assert docs, f"{name}: no documents"
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
        assert doc["kind"] == "Namespace" or doc["metadata"].get("namespace") == "grpo-mesh", doc["metadata"]


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / KUSTOMIZATION).read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"] == "grpo-mesh"
    assert sorted(kustomization["resources"]) == MANIFESTS
    assert (K8S / "README.md").is_file()


def test_one_clusterip_service_per_role() -> None:
    """One Service with a virtual IP per role (headless ones only give pods DNS names); a StatefulSet's
    Service may select its pod 0 alone (the learner's: global rank 0 serves the gRPC API)."""
    services = {n: s for n, s in _objects("Service").items() if s["spec"].get("clusterIP") != "None"}
    assert sorted(services) == sorted(PORTS)
    for role, service in services.items():
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
        (grpc_port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
        assert grpc_port["port"] == PORTS[role]
        labels = dict(_workload(role)["spec"]["template"]["metadata"]["labels"])
        if _workload(role)["kind"] == "StatefulSet":  # the label the controller adds to each pod
            labels["statefulset.kubernetes.io/pod-name"] = f"{role}-0"
        assert service["spec"]["selector"].items() <= labels.items(), f"{role}: selector misses the pods"


@pytest.mark.parametrize("role", sorted(PORTS))
def test_workload_kind_and_replicas(role: str) -> None:
    workload = _workload(role)
    assert workload["kind"] == WORKLOAD_KINDS[role]
    spec = workload["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    if role == "learner":  # one writer of durable state: the ranks, led by rank 0 (test below)
        assert spec["replicas"] == int(_flag(_container(role)["command"], "--nnodes"))
    elif workload["kind"] == "StatefulSet":  # durable state on the PVC: exactly one writer
        assert spec["replicas"] == 1 and spec["serviceName"] == role
    if role == "rollout":
        assert spec["replicas"] >= 2


@pytest.mark.parametrize("role", sorted(PORTS))
def test_command_ports_and_grpc_probes_agree(role: str) -> None:
    container, port = _container(role), PORTS[role]
    _, module, command = _launch(container["command"])
    assert module == f"services.{role}", container["command"]
    assert int(_flag(command, "--port")) == port
    assert _flag(command, "--config") == f"{CONFIG_DIR}/{RUN_CONFIG}"
    assert (ROOT / "services" / role / "__main__.py").exists(), f"python -m services.{role} has no __main__"
    assert _named_port(container, "grpc") == port
    for service_port in _service(role)["spec"]["ports"]:
        target = service_port.get("targetPort", service_port["port"])
        resolved = _named_port(container, target) if isinstance(target, str) else target
        assert resolved in [p["containerPort"] for p in container["ports"]], service_port
        if service_port["name"] == "grpc":
            assert resolved == port
    full_name = health_service_name(role)
    startup = container.get("startupProbe") or container["livenessProbe"]
    if role == "learner":  # one probe command for every pod: learner-probe.py (tested live below)
        probe = ["python", f"{CONFIG_DIR}/{LEARNER_PROBE}"]
        assert container["readinessProbe"]["exec"]["command"] == [*probe, full_name]
        assert container["livenessProbe"]["exec"]["command"] in ([*probe, ""], [*probe, full_name])
        assert startup["exec"]["command"] == [*probe, full_name]
        assert f'"127.0.0.1:{port}"' in _objects("ConfigMap")["grpo-run-config"]["data"][LEARNER_PROBE]
    else:
        assert container["readinessProbe"]["grpc"] == {"port": port, "service": full_name}
        assert container["livenessProbe"]["grpc"]["port"] == port
        assert container["livenessProbe"]["grpc"].get("service", "") in ("", full_name)
        assert startup["grpc"]["port"] == port
    patience = startup.get("initialDelaySeconds", 0) + startup.get("periodSeconds", 10) * startup.get(
        "failureThreshold", 3
    )
    assert patience >= 600, f"{role}: the model load may take minutes, the probe allows {patience}s"


@pytest.mark.parametrize("role", sorted(PORTS))
def test_images_gpus_security_and_grace(role: str) -> None:
    pod, container = _pod(role), _container(role)
    gpu = role in GPU_ROLES
    assert container["image"] == ("grpo-mesh:gpu" if gpu else "grpo-mesh:cpu")
    limits = container.get("resources", {}).get("limits", {})
    if role == "learner":  # one GPU per rank
        assert limits.get("nvidia.com/gpu") == int(_flag(container["command"], "--nproc-per-node")) == 1
    else:
        assert (limits.get("nvidia.com/gpu") == 1) if gpu else "nvidia.com/gpu" not in limits
    for other in pod["containers"]:
        if other is not container:
            assert "nvidia.com/gpu" not in other.get("resources", {}).get("limits", {}), other["name"]
    context = pod["securityContext"]
    assert context["runAsNonRoot"] is True and context["runAsUser"] == UID and context["fsGroup"] == UID
    assert pod["terminationGracePeriodSeconds"] == 30
    assert pod["terminationGracePeriodSeconds"] > settings_class(role).model_fields["grace_seconds"].default


@pytest.mark.parametrize("role", sorted(PORTS))
def test_run_config_and_pvc_mounts(role: str) -> None:
    pod, container = _pod(role), _container(role)
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    (configmap,) = _objects("ConfigMap")
    assert volumes[mounts[CONFIG_DIR]]["configMap"]["name"] == configmap
    (claim,) = _objects("PersistentVolumeClaim").values()
    assert volumes[mounts[DATA]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("role", sorted(PORTS))
def test_env_vars_name_settings_fields_and_validate(
    role: str, run_config_file: Path, clean_env: pytest.MonkeyPatch
) -> None:
    settings_cls = settings_class(role)
    prefix = f"GRPO_{role.upper()}__"
    assert settings_cls.model_config.get("env_prefix") == prefix
    environment = _environment(_container(role))
    grpo_vars = {k: v for k, v in environment.items() if k.startswith("GRPO_")}
    assert f"{prefix}HOST" in grpo_vars
    for key in grpo_vars:
        assert key.startswith(prefix), f"{role}: {key} is not for {role} ({prefix}*)"
        error = field_path_error(settings_cls, key.removeprefix(prefix).lower().split("__"))
        assert error is None, f"{role}: {key}: {error}"
    for key, value in grpo_vars.items():
        clean_env.setenv(key, value)
    settings = settings_cls.load(run_config_file, port=PORTS[role])
    assert settings.host == "0.0.0.0", f"{role}: must bind all interfaces inside its pod"
    if role == "rollout":
        assert settings.rollout_id == DOWNWARD["metadata.name"], "each replica needs its own rollout id"
        # it registers itself at its pod's address (tests/rollout/test_registration.py)
        assert settings.registration.scheduler_address == f"scheduler:{PORTS['scheduler']}"
        assert settings.registration.advertise_address == f"{DOWNWARD['status.podIP']}:{PORTS['rollout']}"


@pytest.mark.parametrize("role", sorted(PORTS))
def test_peer_addresses_point_at_services(role: str) -> None:
    services = _objects("Service")
    for container in _pod(role)["containers"]:
        for key, value in _environment(container).items():
            for host, port in ADDRESS.findall(value):
                assert host in services, f"{role}/{container['name']}: {key}={value}: no Service {host!r}"
                assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], (key, value)
                if host in PORTS and int(port) != COLLECTIVE_PORT:
                    assert int(port) == PORTS[host], f"{key}={value}: {host} listens on {PORTS[host]}"


def test_scheduler_reaches_env_and_learner_and_waits_for_registered_rollouts() -> None:
    environment = _environment(_container("scheduler"))
    assert environment["GRPO_SCHEDULER__ENV_ADDRESS"] == f"env:{PORTS['env']}"
    assert environment["GRPO_SCHEDULER__LEARNER_ADDRESS"] == f"learner:{PORTS['learner']}"
    # Not the rollout Service: its virtual IP would pin one replica and hide the others.
    assert yaml.safe_load(environment["GRPO_SCHEDULER__ROLLOUT_ADDRESSES"]) == []


def test_nccl_weight_transport_with_a_fixed_rendezvous_port() -> None:
    learner, rollout = _container("learner"), _container("rollout")
    learner_env, rollout_env = _environment(learner), _environment(rollout)
    assert _environment(_container("scheduler"))["GRPO_SCHEDULER__WEIGHT_TRANSPORT"] == "nccl"
    assert int(learner_env["GRPO_LEARNER__PUBLISH__COLLECTIVE_PORT"]) == COLLECTIVE_PORT
    assert _named_port(learner, "collective") == COLLECTIVE_PORT
    (collective,) = [p for p in _service("learner")["spec"]["ports"] if p["name"] == "collective"]
    assert collective["port"] == COLLECTIVE_PORT
    # The rendezvous host is the advertised address's host: it must be the learner Service.
    assert learner_env["GRPO_LEARNER__PUBLISH__ADVERTISE_ADDRESS"] == f"learner:{PORTS['learner']}"
    nccl = {k: v for k, v in learner_env.items() if k.startswith("NCCL_")}
    assert nccl and nccl == {k: v for k, v in rollout_env.items() if k.startswith("NCCL_")}


def test_run_config_keeps_durable_state_on_the_pvc() -> None:
    config = _run_config()
    assert config["scheduler"]["run_dir"].startswith(f"{DATA}/")
    checkpoint = config["learner"]["checkpoint"]
    assert checkpoint["dir"].startswith(f"{DATA}/") and checkpoint["resume"] and checkpoint["every"] > 0
    assert config["learner"]["model"] == config["rollout"]["model"]


@pytest.mark.parametrize("role", sorted(PORTS))
def test_run_config_tables_validate(role: str, run_config_file: Path, clean_env: pytest.MonkeyPatch) -> None:
    settings = settings_class(role).load(run_config_file, port=PORTS[role])
    if role == "scheduler":
        assert str(settings.run_dir).startswith(f"{DATA}/")
    if role == "learner":
        assert str(settings.checkpoint.dir).startswith(f"{DATA}/") and settings.checkpoint.resume


def test_run_config_is_default_toml_with_paths_on_the_pvc() -> None:
    """Kept in step with docker/configs/default.toml: only run_dir and the checkpoint dir differ."""
    ours, default = _run_config(), tomllib.loads((ROOT / "docker/configs/default.toml").read_text())
    for config in (ours, default):
        config["scheduler"].pop("run_dir")
        config["learner"]["checkpoint"].pop("dir")
    assert ours == default


def test_learner_ranks_meet_on_pod_0_through_the_headless_service() -> None:
    """The learner's pods are nodes of one torchrun job, read with torch's own parser: --nnodes = the
    StatefulSet's replicas, --node-rank = the pod's ordinal (downward API), one rank per GPU, a static
    rendezvous on learner-0 through the headless Service (so global rank 0, the rank that serves the
    gRPC API, is on learner-0, the only pod the `learner` Service selects), no restarts of torchrun's own
    (the container restarts the learner as a whole), and a shutdown deadline between the learner's grace
    and the pod's."""
    from torch.distributed.run import get_args_parser

    workload, container = _workload("learner"), _container("learner")
    spec = workload["spec"]
    command = _expanded(container)
    assert command[:3] == ["python", "-m", TORCHRUN], command
    options = get_args_parser().parse_args(command[3:])
    assert options.module and options.training_script == "services.learner"
    assert int(options.nnodes) == spec["replicas"]
    (node_rank,) = [v for v in container["env"] if v["name"] == "NODE_RANK"]
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX
    assert container["command"][container["command"].index("--node-rank") + 1] == "$(NODE_RANK)"
    assert options.node_rank == int(DOWNWARD[POD_INDEX])
    assert int(options.nproc_per_node) == container["resources"]["limits"]["nvidia.com/gpu"]
    assert options.rdzv_backend == "static" and not options.standalone and options.max_restarts == 0
    headless = _headless("learner")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    labels = spec["template"]["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items(), "every learner pod needs its DNS name"
    assert options.master_addr == f"learner-0.{headless['metadata']['name']}"
    assert options.master_port == _named_port(container, "rendezvous") != COLLECTIVE_PORT
    assert [p["port"] for p in headless["spec"]["ports"] if p["name"] == "rendezvous"] == [
        options.master_port
    ]
    assert spec["podManagementPolicy"] == "Parallel", "pod 0 cannot be ready before the others start"
    assert _service("learner")["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "learner-0"
    grace = settings_class("learner").model_fields["grace_seconds"].default
    assert grace < options.shutdown_timeout < _pod("learner")["terminationGracePeriodSeconds"]


class _NamedApp:
    """Serves nothing but health, under one service name."""

    def __init__(self, service_name: str) -> None:
        self.service_names = (service_name,)

    def register(self, server) -> None:
        return None

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


async def _probe(tmp_path: Path, node_rank: str, service: str, ready: bool | None) -> int:
    """Exit code of the ConfigMap's learner-probe.py against a health-only server on a free port
    (`ready` None: no server)."""
    import asyncio
    import sys

    from services.common.config import ServiceSettings
    from services.common.serve import start_server

    script = _objects("ConfigMap")["grpo-run-config"]["data"][LEARNER_PROBE]
    running = None
    if ready is not None:
        running = await start_server(
            _NamedApp(health_service_name("learner")), ServiceSettings(port=0, grace_seconds=0.1)
        )
        if not ready:
            await running.set_ready(False)
        script = script.replace(f"127.0.0.1:{PORTS['learner']}", running.address)
    else:
        script = script.replace(f"127.0.0.1:{PORTS['learner']}", "127.0.0.1:1")
    path = tmp_path / LEARNER_PROBE
    path.write_text(script)
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(path), service, env={**os.environ, "NODE_RANK": node_rank}
        )
        return await asyncio.wait_for(process.wait(), 60)
    finally:
        if running is not None:
            await running.close()


async def test_learner_probe_checks_rank_0s_health_and_passes_elsewhere(tmp_path: Path) -> None:
    full_name = health_service_name("learner")
    assert await _probe(tmp_path, "0", full_name, ready=True) == 0
    assert await _probe(tmp_path, "0", full_name, ready=False) != 0
    assert await _probe(tmp_path, "0", "", ready=True) == 0
    assert await _probe(tmp_path, "0", full_name, ready=None) != 0
    assert await _probe(tmp_path, "1", full_name, ready=None) == 0  # pods other than learner-0 serve nothing
