"""`grpo-mesh`: the project's one command line (also `python -m services`).

    grpo-mesh --help                       every command with its one-line help
    grpo-mesh <command> --help             that command's flags (generated from its settings)
    grpo-mesh demo --steps 40 --secure     (`make demo ARGS="..."` runs this)

COMMANDS is the one table: name → the module that implements it and a line of help. A module is
imported only when its command runs, so `grpo-mesh --help` loads neither torch nor vLLM. Each module
has `parse(argv) -> <its settings>` (pydantic-settings through services/common/config.py `parse_cli`;
SystemExit(2) and one `<prog>: error: --flag: ...` line on a bad command line) and
`main(argv) -> int`. Every command spells booleans the same way: a bare `--flag` or `--no-flag`.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

PROG = "grpo-mesh"


@dataclass(frozen=True)
class Command:
    module: str
    help: str


COMMANDS: dict[str, Command] = {
    "demo": Command("services.launch.demo", "Train end to end on this machine (all four services, local)."),
    "serve": Command("services.launch.serve", "Run one service: env, rollout, learner, scheduler, gateway."),
    "status": Command("services.scheduler.status_view", "A run at a glance, once or live (--watch)."),
    "studio": Command("services.studio.server", "A web page to start, watch and inspect runs."),
    "audit": Command("services.scheduler.ledger.audit", "Check a run's ledger for exactly-once training."),
    "check-env": Command("services.env.check", "Smoke-test an environment before training."),
    "prepare": Command("services.launch.prepare", "A deployment's one-shot set-up step (compose's init)."),
    "certs": Command("services.launch.certs", "Throwaway CA, certificates and token for TLS by hand."),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: {PROG} <command> [options]      ({PROG} <command> --help: that command's options)",
        "",
        "Asynchronous GRPO training as four gRPC services: environment, rollout, learner, scheduler.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {command.help}" for name, command in COMMANDS.items()),
        "",
        "Booleans are a bare --flag or --no-flag in every command. Without the console script:",
        "python -m services <command> [options].",
    ]
    return "\n".join(lines)


def load(name: str) -> ModuleType:
    """The module implementing command `name` (imported now, not before)."""
    return importlib.import_module(COMMANDS[name].module)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"{PROG}: error: unknown command {name!r} (commands: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        return load(name).main(rest) or 0
    except SystemExit as exc:  # --help (0), a bad command line (2), a service's own exit
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
