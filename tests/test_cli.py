"""services/cli.py: `grpo-mesh`, the one command line: its table, help, errors, and one boolean
convention across every settings class a command parses (nested models included)."""

from __future__ import annotations

import subprocess
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import BaseModel

from services import cli
from services.launch import serve

ROOT = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = Path(sys.executable).parent / "grpo-mesh"

# The smallest valid command line of every command (its required positionals and flags), so a test
# can add one flag to it. A command added to the table must be added here (checked below).
MINIMAL: dict[str, list[str]] = {
    "demo": [],
    "serve env": ["env"],
    "serve rollout": ["rollout", "--model", "m"],
    "serve learner": ["learner", "--model", "m"],
    "serve scheduler": ["scheduler"],
    "serve gateway": ["gateway", "--rollouts", "127.0.0.1:50052"],
    "status": [],
    "studio": [],
    "audit": ["runs/demo"],
    "check-env": ["arithmetic"],
    "prepare": ["--config", "run.toml"],
    "certs": ["tls"],
}


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GRPO_* variable or run-config of the caller's shell leaks into what is parsed."""
    import os

    for key in list(os.environ):
        if key.upper().startswith("GRPO_"):
            monkeypatch.delenv(key)


def _parse(key: str, extra: list[str]) -> BaseModel:
    """The settings `grpo-mesh <key> ... extra` parses to, through the command module's own parse()."""
    name = key.split()[0]
    return cli.load(name).parse([*MINIMAL[key], *extra])


def test_the_table_and_this_test_name_the_same_commands() -> None:
    assert {key.split()[0] for key in MINIMAL} == set(cli.COMMANDS)
    assert {key.split()[1] for key in MINIMAL if key.startswith("serve ")} == set(serve.SERVICES)


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_module_has_parse_main_and_says_how_to_run_it(name: str) -> None:
    module = cli.load(name)
    assert callable(module.parse) and callable(module.main)
    assert f"grpo-mesh {name}" in (module.__doc__ or ""), f"{module.__name__}'s docstring"


def _no_heavy_imports(command: str) -> str:
    return (
        "import sys; from services.cli import main; rc = main(" + command + "); "
        "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules); "
        "assert not heavy, heavy; sys.exit(rc)"
    )


def test_help_lists_every_command_from_the_console_script_and_python_m_services() -> None:
    if not CONSOLE_SCRIPT.exists():
        pytest.fail(f"{CONSOLE_SCRIPT} missing: `make install` (or `.venv/bin/pip install -e . --no-deps`)")
    for command in ([str(CONSOLE_SCRIPT), "--help"], [sys.executable, "-m", "services", "--help"]):
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: grpo-mesh <command>")
        for name, entry in cli.COMMANDS.items():
            assert f"  {name}" in done.stdout and entry.help in done.stdout, name
    bare = subprocess.run([str(CONSOLE_SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and all(name in bare.stderr for name in cli.COMMANDS)


def test_help_imports_neither_torch_nor_vllm() -> None:
    for command in ("['--help']", "['serve', '--help']", "['nonsense']"):
        child = [sys.executable, "-c", _no_heavy_imports(command)]
        done = subprocess.run(child, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode in (0, 2), command + done.stderr


@pytest.mark.parametrize("key", list(MINIMAL))
def test_every_command_has_generated_help(key: str, capsys: pytest.CaptureFixture[str]) -> None:
    words = key.split()
    assert cli.main([*words, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: grpo-mesh {key} "), out[:200]
    assert "-h, --help" in out


def test_serve_without_a_service_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in serve.SERVICES)
    assert cli.main(["serve"]) == 2
    assert cli.main(["serve", "trainer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    choices = "env, rollout, learner, scheduler, gateway"
    assert err[-1] == f"grpo-mesh serve: error: unknown service 'trainer' (choose from {choices})"


def test_an_unknown_command_is_one_line_naming_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["trian"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("grpo-mesh: error: unknown command 'trian'")
    assert all(name in err[0] for name in cli.COMMANDS)


@pytest.mark.parametrize("key", list(MINIMAL))
def test_a_bad_flag_or_value_is_one_line_and_exit_2(key: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert _parse(key, []) is not None  # the minimal line itself is valid
    words = key.split()
    assert cli.main([*words, *MINIMAL[key][len(words) - 1 :], "--no-such-flag", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"grpo-mesh {key}: error: --no-such-flag: no such option (--help lists them)"]


@pytest.mark.parametrize(
    ("key", "argv", "expected"),
    [
        (
            "demo",
            ["--steps", "0"],
            "grpo-mesh demo: error: --steps: Input should be greater than or equal to 1",
        ),
        (
            "status",
            ["--interval", "x"],
            "grpo-mesh status: error: --interval: Input should be a valid number",
        ),
        ("serve learner", ["--optim.lr", "fast"], "grpo-mesh serve learner: error: --optim.lr: Input should"),
        ("audit", [], "grpo-mesh audit: error: the following arguments are required: RUN-DIR"),
    ],
)
def test_bad_values_name_their_flag(key: str, argv: list[str], expected: str, capsys) -> None:
    words = key.split()
    line = [*words, *(argv if key == "audit" else [*MINIMAL[key][len(words) - 1 :], *argv])]
    assert cli.main(line) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(expected), err


# ---- one boolean convention -------------------------------------------------------------------------


def _options(annotation: object) -> tuple[object, ...]:
    """The types an annotation allows (X | None → X)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def bool_flags(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    """Every boolean field of `model` and of the models nested in it, as a flag (`checkpoint.background`)."""
    for name, field in model.model_fields.items():
        flag = prefix + name.replace("_", "-")
        options = _options(field.annotation)
        if bool in options:
            yield flag
        for option in options:
            if isinstance(option, type) and issubclass(option, BaseModel):
                yield from bool_flags(option, flag + ".")


def _value(settings: BaseModel, flag: str) -> object:
    value: object = settings
    for part in flag.split("."):
        value = getattr(value, part.replace("-", "_"))
    return value


def _bool_cases() -> Iterator[tuple[str, str]]:
    for key in MINIMAL:
        for flag in bool_flags(type(_parse(key, []))):
            yield key, flag


BOOL_CASES = list(_bool_cases())
# What a boolean needs beside it to validate when it is on (a cross-field check, not the parsing)
TLS = ["--security.tls-cert", "c.pem", "--security.tls-key", "c.key", "--security.tls-ca", "ca.pem"]
COMPANIONS = {"security.require-client-cert": TLS, "checkpoint.resume": ["--checkpoint.dir", "ckpt"]}


def test_the_walk_finds_nested_booleans() -> None:
    found = set(BOOL_CASES)
    for case in [
        ("demo", "secure"),
        ("demo", "lend-idle-cores"),
        ("serve learner", "checkpoint.background"),
        ("serve scheduler", "trace"),
        ("status", "until-finished"),
        ("certs", "overwrite"),
    ]:
        assert case in found, case
    assert len(found) > 20


@pytest.mark.parametrize(("key", "flag"), BOOL_CASES, ids=[f"{k}:--{f}" for k, f in BOOL_CASES])
def test_every_boolean_is_flag_or_no_flag(key: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    companions = COMPANIONS.get(flag, [])
    assert _value(_parse(key, [*companions, f"--{flag}"]), flag) is True
    assert _value(_parse(key, [*companions, f"--no-{flag}"]), flag) is False
    for spelled in ([*companions, f"--{flag}", "true"], [*companions, f"--{flag}=false"]):
        with pytest.raises(SystemExit) as refused:
            _parse(key, spelled)
        assert refused.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"grpo-mesh {key}: error: --{flag}: a boolean flag takes no value "
            f"(got {spelled[-1].split('=')[-1]!r}); write --{flag} or --no-{flag}"
        ], err


# ---- the services' own programs ----------------------------------------------------------------------


def test_a_service_refuses_a_subcommand_word_pointing_at_grpo_mesh() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "services.scheduler", "audit", "x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("python -m services.scheduler: error: unexpected argument 'audit'")
    assert "`grpo-mesh <cmd>`" in lines[0] and "grpo-mesh --help" in lines[0]


@pytest.mark.parametrize("service", list(serve.SERVICES))
def test_serve_and_python_m_parse_the_same_settings(service: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags = [*MINIMAL[f"serve {service}"][1:], "--port", "50999"]
    via_serve = serve.parse([service, *flags])
    assert type(via_serve) is serve.settings_class(service)
    assert via_serve == serve.settings_class(service).from_cli(flags, prog=f"python -m services.{service}")
    with pytest.raises(SystemExit) as refused:
        serve.parse([service, "check", *flags])
    assert refused.value.code == 2
    assert "subcommands are `grpo-mesh <cmd>`" in capsys.readouterr().err
