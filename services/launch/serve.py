"""`grpo-mesh serve env|rollout|learner|scheduler [--flags]`: run one service, exactly as
`python -m services.<svc> [--flags]` does (the form docker-compose.yml and deploy/k8s use): the same
settings (flags > `GRPO_<SVC>__*` > the run-config's table > defaults) and `--help` for every flag.

    grpo-mesh serve env --port 50051
    grpo-mesh serve learner --port 50053 --model .cache/tiny-model-warm120 --optim.lr 4e-4
    grpo-mesh serve scheduler --help
"""

from __future__ import annotations

import importlib
import sys

from services.common.config import ServiceSettings

PROG = "grpo-mesh serve"

# service → (module of its settings, settings class, one-line help); imported only when chosen
SERVICES: dict[str, tuple[str, str, str]] = {
    "env": ("services.env.config", "EnvSettings", "the Environment service: prompts and scoring"),
    "rollout": ("services.rollout.config", "RolloutSettings", "a rollout worker: vLLM or transformers"),
    "learner": ("services.learner.config", "LearnerSettings", "the Learner service: train steps, weights"),
    "scheduler": ("services.scheduler.config", "SchedulerSettings", "the Scheduler: the one orchestrator"),
    "gateway": ("services.gateway.config", "GatewaySettings", "the OpenAI-compatible HTTP gateway"),
}


def usage(prog: str = PROG) -> str:
    lines = [f"usage: {prog} {{{','.join(SERVICES)}}} [--flags]   ({prog} SERVICE --help: its flags)", ""]
    lines += [f"  {name:<10} {text}" for name, (_, _, text) in SERVICES.items()]
    return "\n".join(lines)


def _split(argv: list[str], prog: str) -> tuple[str, list[str]]:
    """The service named first and its flags; usage (exit 0 on --help, else 2) when none is named."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(prog), file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    if argv[0] not in SERVICES:
        print(
            f"{prog}: error: unknown service {argv[0]!r} (choose from {', '.join(SERVICES)})", file=sys.stderr
        )
        raise SystemExit(2)
    return argv[0], argv[1:]


def settings_class(service: str) -> type[ServiceSettings]:
    module, name, _ = SERVICES[service]
    return getattr(importlib.import_module(module), name)


def parse(argv: list[str], prog: str = PROG) -> ServiceSettings:
    """The named service's settings, read as that service reads them; SystemExit(2) on a bad line."""
    service, flags = _split(argv, prog)
    return settings_class(service).from_cli(flags, prog=f"{prog} {service}")


def main(argv: list[str]) -> int:
    service, flags = _split(argv, PROG)
    server = importlib.import_module(f"services.{service}.server")
    server.main(flags, prog=f"{PROG} {service}")
    return 0
