"""The parsers tests/doc_commands.py checks a documented command with: each grpo-mesh command's own
parse() and the services' settings (as from_cli reads them), the Makefile, the scripts' and benches'
argparse flags (read with ast), the generated gRPC descriptors for grpcurl, and docker-compose.yml.

Each `check_*` takes a command's words after its program and returns its problems as one-line
strings (a parse() error is the line the command itself prints before exit 2).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import pkgutil
import re
import shlex
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path

import yaml
from google.protobuf import json_format
from google.protobuf.descriptor_pool import Default as default_pool
from google.protobuf.message_factory import GetMessageClass

from services import cli
from services.launch import serve

ROOT = Path(__file__).resolve().parents[1]
# `N` in `--n N`, `RUN_DIR`, `HOST:PORT`: a placeholder a reader replaces, so the line is a synopsis
METAVARIABLE = re.compile(r"^[A-Z][A-Z0-9_]*(:[A-Z][A-Z0-9_]*)?$")


# ---- grpo-mesh commands and the services ------------------------------------------------------


def run_parse(parse: Callable[[list[str]], object], argv: list[str]) -> list[str]:
    """The one-line errors `parse(argv)` prints before SystemExit(2); [] when it parses (or is --help)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            parse(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):
                return [line for line in err.getvalue().splitlines() if line.strip()] or [f"exit {exc.code}"]
        except Exception as exc:
            return [f"{type(exc).__name__}: {exc}"]
    return []


@cache
def help_flags(key: str) -> frozenset[str]:
    """Every option a command's generated --help names (`key`: "demo", "serve learner", ...)."""
    words = key.split()
    out = io.StringIO()
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(io.StringIO()),
        contextlib.suppress(SystemExit),
    ):
        cli.load(words[0]).parse([*words[1:], "--help"])
    flags = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w.-]*)", out.getvalue()))
    return frozenset(flags | {f"--{f[1:]}" for f in flags if len(f) == 2})  # `-n` is also `--n` (check-env)


def synopsis_problems(key: str, words: list[str]) -> list[str]:
    """A usage synopsis: only the flag names are checked (its values are placeholders)."""
    known = help_flags(key)
    names = {w.strip("[](){}|,").split("=")[0] for w in words}
    unknown = sorted(name for name in names if name.startswith("--") and name not in known)
    return [f"{name}: no such option of grpo-mesh {key}" for name in unknown]


@cache
def empty_config() -> Path:
    """What an example's `--config run.toml` (no file in the repo) becomes: an empty run-config."""
    path = Path(tempfile.mkdtemp(prefix="grpo-doc-check-")) / "run.toml"
    path.write_text("")
    return path


def config_file(value: str) -> Path:
    """The repo file a documented `--config` names (compose mounts docker/configs at /app/configs),
    or an empty run-config when it names none."""
    for candidate in (ROOT / value, ROOT / "docker/configs" / value.removeprefix("/app/configs/")):
        if value and candidate.is_file():
            return candidate
    return empty_config()


def with_configs(argv: list[str]) -> list[str]:
    """`--config X` → the repo's file X, read as a service reads it (or an empty run-config)."""
    out = list(argv)
    for index, arg in enumerate(out):
        if arg.startswith("--config="):
            out[index] = f"--config={config_file(arg.split('=', 1)[1])}"
        elif arg == "--config" and index + 1 < len(out):
            out[index + 1] = str(config_file(out[index + 1]))
    return out


def check_cli_command(key: str, argv: list[str], synopsis: bool) -> list[str]:
    """`grpo-mesh <key> argv` (key: a command, or "serve <svc>")."""
    if synopsis:
        return synopsis_problems(key, argv)
    words = key.split()
    errors = run_parse(cli.load(words[0]).parse, [*words[1:], *with_configs(argv)])
    if errors and any(METAVARIABLE.match(arg) for arg in argv):  # `--n N`: a synopsis after all
        return synopsis_problems(key, argv)
    return errors


def check_grpo_mesh(argv: list[str], synopsis: bool) -> list[str]:
    if not argv or argv[0] in ("-h", "--help") or re.fullmatch(r"<[\w-]+>", argv[0]):
        return []
    names = argv[0].strip("[]{}").replace(",", "|").split("|")
    unknown = [name for name in names if name not in cli.COMMANDS]
    if unknown:
        return [
            f"grpo-mesh has no command {name!r} (commands: {', '.join(cli.COMMANDS)})" for name in unknown
        ]
    if len(names) > 1:
        return []
    if names[0] == "serve" and len(argv) > 1 and not argv[1].startswith("-"):
        services = argv[1].strip("[]{}").replace(",", "|").split("|")
        if any(s not in serve.SERVICES for s in services) and not re.fullmatch(r"<[\w-]+>", argv[1]):
            return [f"grpo-mesh serve: no service {argv[1]!r} (services: {', '.join(serve.SERVICES)})"]
        if len(services) > 1 or argv[1].startswith("<"):
            return []
        return check_cli_command(f"serve {services[0]}", argv[2:], synopsis)
    return check_cli_command(names[0], argv[1:], synopsis)


def check_service(service: str, argv: list[str], synopsis: bool) -> list[str]:
    """`python -m services.<service> argv`, parsed by the service's settings as from_cli does."""
    if synopsis:
        return synopsis_problems(f"serve {service}", argv)
    settings = serve.settings_class(service)
    errors = run_parse(
        lambda a: settings.from_cli(a, prog=f"python -m services.{service}"), with_configs(argv)
    )
    if errors and any(METAVARIABLE.match(arg) for arg in argv):
        return synopsis_problems(f"serve {service}", argv)
    return errors


@cache
def makefile() -> tuple[frozenset[str], frozenset[str]]:
    """The Makefile's targets, and the variables a `make` command line may set: those the Makefile,
    the scripts it runs and docker-compose.yml (make up) read."""
    text = (ROOT / "Makefile").read_text()
    targets = {m for m in re.findall(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", text, re.M)}
    variables = set(re.findall(r"\$\((\w+)\)", text)) | set(re.findall(r"^(\w+)\s*[?:]?=", text, re.M))
    for script in set(re.findall(r"scripts/[\w-]+\.sh", text)) | {"docker-compose.yml"}:
        if (ROOT / script).exists():
            variables |= set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", (ROOT / script).read_text()))
    return frozenset(targets), frozenset(variables)


def check_make(argv: list[str], synopsis: bool) -> list[str]:
    targets, variables = makefile()
    problems = []
    assigned: dict[str, str] = {}
    goals = []
    for arg in argv:
        if arg.startswith("-"):
            continue
        if "=" in arg:
            name, value = arg.split("=", 1)
            name = name.strip("[")
            assigned[name] = value.rstrip("]")
            if name not in variables:
                problems.append(f"make: the Makefile reads no variable {name!r}")
        elif not METAVARIABLE.match(arg.strip("[]")) and "|" not in arg:
            goals.append(arg)
    problems += [f"make: no target {goal!r} in the Makefile" for goal in goals if goal not in targets]
    if "demo" in goals and not synopsis:
        demo = []
        for flag, name in (("--model", "MODEL"), ("--steps", "STEPS"), ("--run-dir", "RUN_DIR")):
            if name in assigned:
                demo += [flag, assigned[name]]
        try:
            demo += shlex.split(assigned.get("ARGS", ""))
        except ValueError as exc:
            return [*problems, f"make demo: ARGS: {exc}"]
        if not any(METAVARIABLE.match(arg) for arg in demo):
            problems += check_cli_command("demo", demo, synopsis=False)
    return problems


@cache
def script_flags(path: Path) -> frozenset[str]:
    """The option strings a script's argparse parser defines (every `add_argument("--x", ...)`)."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value)[:1] == "-"}
    return frozenset(flags)


def check_script(script: str, argv: list[str]) -> list[str]:
    path = ROOT / script
    if not path.is_file():
        return [f"{script}: no such file"]
    if path.suffix != ".py":
        return []
    known = script_flags(path)
    problems = []
    for arg in argv:
        name = arg.strip("[]").split("=")[0]
        if name.startswith("--") and name not in known:
            matches = [flag for flag in known if flag.startswith(name)]  # argparse takes a unique prefix
            if len(matches) != 1:
                problems.append(f"{script}: no option {name} (its parser has {', '.join(sorted(known))})")
    return problems


# ---- grpcurl ----------------------------------------------------------------------------------------

GRPCURL_VALUE_FLAGS = {
    "H", "rpc-header", "reflect-header", "authority", "cacert", "cert", "key", "connect-timeout", "d",
    "format", "import-path", "keepalive-time", "max-msg-sz", "max-time", "proto", "protoset",
    "protoset-out", "proto-out-dir", "servername", "user-agent", "alts-handshaker-service",
    "alts-target-service-account",
}  # fmt: skip


@cache
def descriptor_pool():
    """The default pool with every generated module of grpo/ and grpc.health.v1 / reflection loaded."""
    import grpo

    for info in pkgutil.walk_packages(grpo.__path__, "grpo."):
        if info.name.endswith("_pb2"):
            importlib.import_module(info.name)
    importlib.import_module("grpc_health.v1.health_pb2")
    importlib.import_module("grpc_reflection.v1alpha.reflection_pb2")
    return default_pool()


@cache
def rpc_count() -> int:
    """The RPC methods of protos/ (the grpo.* services of the generated descriptors)."""
    import grpo

    count = 0
    for info in pkgutil.walk_packages(grpo.__path__, "grpo."):
        if info.name.endswith("_pb2"):
            module = importlib.import_module(info.name)
            count += sum(len(s.methods) for s in module.DESCRIPTOR.services_by_name.values())
    return count


def check_grpcurl(argv: list[str]) -> list[str]:
    positional: list[str] = []
    body = None
    index = 0
    while index < len(argv):
        arg = argv[index]
        name = arg.lstrip("-").split("=")[0]
        if arg.startswith("-") and len(arg) > 1:
            if name in GRPCURL_VALUE_FLAGS and "=" not in arg:
                value = argv[index + 1] if index + 1 < len(argv) else ""
                body = value if name == "d" else body
                index += 1
            elif name == "d":
                body = arg.split("=", 1)[1]
        else:
            positional.append(arg)
        index += 1
    pool = descriptor_pool()
    if len(positional) < 2:
        return []
    verb = positional[1]
    if verb in ("list", "describe"):
        for symbol in positional[2:3]:
            try:
                find = pool.FindServiceByName if verb == "list" else pool.FindFileContainingSymbol
                find(symbol.lstrip("."))
            except KeyError:
                what = "service" if verb == "list" else "symbol"
                return [f"grpcurl {verb}: no {what} {symbol!r} in protos/ (or grpc.health.v1)"]
        return []
    service_name, _, method_name = verb.replace("/", ".").rpartition(".")
    try:
        method = pool.FindServiceByName(service_name).methods_by_name[method_name]
    except KeyError:
        return [f"grpcurl: no method {verb!r} in protos/ (or grpc.health.v1)"]
    if body is not None and body != "@":
        try:
            json_format.Parse(body, GetMessageClass(method.input_type)())
        except json_format.ParseError as exc:
            return [f"grpcurl {verb}: -d body is no {method.input_type.full_name}: {exc}"]
    return []


# ---- docker compose ---------------------------------------------------------------------------------

COMPOSE_VALUE_FLAGS = {
    "--tail", "-t", "--timeout", "--scale", "-e", "--env", "-u", "--user", "-w", "--workdir", "--index",
    "--entrypoint", "--name", "--wait-timeout", "--pull", "--since", "--until",
}  # fmt: skip
COMPOSE_SERVICE_COMMANDS = {
    "up", "down", "logs", "stop", "start", "restart", "ps", "build", "pull", "kill", "rm", "create", "pause",
    "unpause", "top", "events", "images", "port",
}  # fmt: skip


@cache
def compose() -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """docker-compose.yml's profiles, and each service's profiles."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    profiles = {name: frozenset(spec.get("profiles", ())) for name, spec in services.items()}
    return frozenset().union(*profiles.values()), profiles


def check_compose(argv: list[str]) -> list[str]:
    all_profiles, services = compose()
    profiles: list[str] = []
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        if argv[index] == "--profile" and index + 1 < len(argv):
            profiles.append(argv[index + 1])
        index += 1 if "=" in argv[index] or argv[index] in ("-d", "--dry-run") else 2
    problems = [
        f"docker compose: no profile {p!r} in docker-compose.yml" for p in profiles if p not in all_profiles
    ]
    if index >= len(argv):
        return problems
    command, rest = argv[index], argv[index + 1 :]
    named: list[str] = []
    skip = False
    for arg in rest:
        if skip:
            skip = False
        elif arg.startswith("-"):
            skip = arg in COMPOSE_VALUE_FLAGS
        else:
            named.append(arg)
    if command in ("exec", "run"):
        named = named[:1]
    elif command not in COMPOSE_SERVICE_COMMANDS:
        named = []
    for name in named:
        if name not in services:
            problems.append(f"docker compose: no service {name!r} in docker-compose.yml")
        elif profiles and services[name] and not services[name] & set(profiles):
            problems.append(f"docker compose: service {name!r} is not in profile {', '.join(profiles)}")
    return problems
