"""`grpo-mesh status`: a run at a glance in the terminal, from GetStatus.

    grpo-mesh status                                     # once, $GRPO_SCHEDULER_ADDRESS or 127.0.0.1:50050
    grpo-mesh status --address 127.0.0.1:50050           # once
    grpo-mesh status --run-dir runs/demo --watch         # live, until Ctrl-C
    grpo-mesh status --watch --until-finished            # live, until the run ends

One table for the run (state, step/max, learner version, rates, reward, loss, staleness, alignment,
the last sync's phases, uptime, the error if it failed), one for queues and groups, one for the
rollouts (version, load, health; a rollout behind the learner is yellow, an unhealthy one red).
`render` is pure, so tests render it to text. `--run-dir` finds the scheduler through the port file
the launcher writes (`<run_dir>/scheduler.port`) and, when the run's config (`<run_dir>/run.toml`)
has a `[security]` table (`make demo ARGS="--secure"`), dials with its TLS material, the
operator's client certificate and the token; when that run's scheduler is not running (finished,
stopped, crashed) the same view comes from the run's record (`ledger/run_record.py`: run.toml,
metrics.jsonl and the ledger, read-only), under a line that says so. Exit codes: 0 shown (with
--until-finished: the run finished), 1 the run failed, 2 the scheduler could not be asked
(unreachable, refused, misconfigured) or the command line is wrong.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import tomllib
from pathlib import Path

from pydantic import Field
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.clients import GrpcClient
from services.common.config import CommandSettings, parse_cli
from services.common.errors import GrpoError
from services.common.security import ClientSecurity, SecuritySettings
from services.scheduler.ledger.run_record import RunRecord, has_record, read_record

ADDRESS_ENV = "GRPO_SCHEDULER_ADDRESS"
# The scheduler binds a free port unless told (--port, default 0); 50050 is the one compose, the
# README and docs/operations.md give it, so the default reaches a `docker compose up` run.
DEFAULT_ADDRESS = "127.0.0.1:50050"

Status = scheduler_pb2.GetStatusResponse
PROG = "grpo-mesh status"


class StatusSettings(CommandSettings):
    """A run at a glance, from the scheduler's GetStatus: once, or live with --watch.

    Exit 0 shown (with --until-finished: the run finished), 1 the run failed, 2 the scheduler could
    not be asked (unreachable, refused, misconfigured).
    """

    address: str = Field(
        default="",
        description=f"host:port of the scheduler (else --run-dir's, ${ADDRESS_ENV}, {DEFAULT_ADDRESS}).",
    )
    run_dir: Path | None = Field(
        default=None, description="A launcher's run dir: its scheduler port file, TLS material and token."
    )
    watch: bool = Field(default=False, description="Refresh until Ctrl-C.")
    until_finished: bool = Field(
        default=False, description="Watch until the run ends (exit 1 if it failed); implies --watch."
    )
    interval: float = Field(default=2.0, gt=0, description="Seconds between refreshes.")
    timeout: float = Field(default=5.0, gt=0, description="Deadline of each GetStatus, in seconds.")


# ---- pure formatting ---------------------------------------------------------------------------


def duration(seconds: float) -> str:
    """3725 → "1h02m05s", 65 → "1m05s"."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def progress(step: int, max_steps: int) -> str:
    """ "12/40 (30%)", or "12 (until stopped)" when the run has no max_steps."""
    return f"{step}/{max_steps} ({step / max_steps:.0%})" if max_steps > 0 else f"{step} (until stopped)"


def run_state(s: Status) -> Text:
    """failed (red) > finished (green) > paused (yellow) > training: a failed run also reads finished."""
    if s.error:
        return Text("failed", style="bold red")
    if s.finished:
        return Text("finished", style="green")
    return Text("paused", style="yellow") if s.paused else Text("training")


def sync_phases(s: Status) -> str:
    sync = s.last_sync
    if sync.total_ms <= 0:
        return f"none yet (transport {s.weight_transport or '?'})"
    return (
        f"{sync.total_ms:.1f} ms (prepare {sync.prepare_ms:.1f} · stage {sync.stage_ms:.1f} · "
        f"commit {sync.commit_ms:.1f}) via {s.weight_transport or '?'}"
    )


def alignment(s: Status) -> str:
    """The last probe's max |Δ logprob| on sampled tokens; unset before the first probe and when no
    rollout answered the last one."""
    return f"{s.logprob_abs_diff_max:.2e}" if s.HasField("logprob_abs_diff_max") else "not measured"


def rollout_style(r: scheduler_pb2.RolloutLoad, learner_version: int) -> str:
    """red: not answering; yellow: serving weights older than the learner's; plain otherwise."""
    return "red" if not r.healthy else "yellow" if r.weight_version < learner_version else ""


def recorded_state(record: RunRecord) -> Text:
    """A recorded run's state: how it ended, or that it ended without saying (killed)."""
    if record.ending == "failed":
        return Text("failed", style="bold red")
    if record.ending == "finished":
        return Text("finished", style="green")
    if record.ending == "stopped":
        return Text("stopped", style="yellow")
    return Text("not running (no ending recorded: killed or crashed)", style="bold red")


def run_table(s: Status, address: str, state: Text | None = None) -> Table:
    table = Table(title=f"grpo-mesh run @ {address}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    rows: list[tuple[str, str | Text]] = [
        ("state", state or run_state(s)),
        ("step", progress(s.step, s.max_steps)),
        ("learner version", str(s.learner_version)),
        ("steps/s", f"{s.steps_per_second:.2f}"),
        ("tokens/s", f"{s.tokens_per_second:.0f}"),
        ("reward (last step)", f"{s.reward_mean:.4f}"),
        ("loss (last step)", f"{s.loss:.5f}"),
        ("staleness (mean)", f"{s.staleness_mean:.2f}"),
        ("alignment |Δ logprob|", alignment(s)),
        ("last sync", sync_phases(s)),
        ("uptime", duration(s.uptime_seconds)),
    ]
    if s.level_success:  # an env with difficulty levels: each level's recent success rate
        levels = sorted(s.level_success.items(), key=lambda kv: (not kv[0].isdigit(), kv[0].zfill(9)))
        rows.append(("level success", "  ".join(f"{k}: {v:.2f}" for k, v in levels)))  # a map: no order
    if s.error:
        rows.append(("error", Text(s.error, style="red")))
    for name, value in rows:
        table.add_row(name, value)
    return table


def queue_table(s: Status) -> Table:
    table = Table(title="queues and groups", title_justify="left")
    table.add_column("name")
    table.add_column("count", justify="right")
    for name, depth in sorted(s.queue_depths.items()):
        table.add_row(f"queue {name}", str(depth))
    for state, count in sorted(s.groups_by_state.items()):
        table.add_row(f"groups {state}", str(count))
    return table


def rollout_table(s: Status) -> Table:
    behind = sum(1 for r in s.rollouts if r.weight_version < s.learner_version)
    down = sum(1 for r in s.rollouts if not r.healthy)
    title = f"rollouts ({len(s.rollouts)}; {behind} behind, {down} unhealthy)"
    table = Table(title=title, title_justify="left")
    for column in ("rollout", "address", "version", "load", "healthy"):
        table.add_column(column, justify="right" if column in ("version", "load") else "left")
    for r in s.rollouts:
        lag = s.learner_version - r.weight_version
        table.add_row(
            r.rollout_id or "?",
            r.address,
            f"{r.weight_version} (-{lag})" if lag > 0 else str(r.weight_version),
            f"{r.in_flight}/{r.max_in_flight}",
            "✓" if r.healthy else "✗",
            style=rollout_style(r, s.learner_version),
        )
    return table


def render(status: Status, address: str) -> Group:
    """The whole view of one GetStatus answer (pure)."""
    return Group(run_table(status, address), queue_table(status), rollout_table(status))


def render_record(record: RunRecord, run_dir: Path, why: str) -> Group:
    """The view of a run whose scheduler is not running, from its record (pure)."""
    line = Text(f"the scheduler is not running ({why}): from the run's record", style="yellow")
    table = run_table(record.status, str(run_dir), recorded_state(record))
    return Group(line, table, queue_table(record.status))


def unreachable(address: str, error: str, last: Status | None) -> RenderableType:
    """Watch mode's view while the scheduler does not answer: a red line above the last view seen."""
    line = Text(f"scheduler {address} unreachable: {error} (retrying)", style="bold red")
    return line if last is None else Group(line, render(last, address))


def _reason(exc: BaseException, address: str) -> str:
    """A failure as one line, without the address the caller names anyway."""
    return " ".join(str(exc).removeprefix(f"{address}: ").split()) or type(exc).__name__


# ---- finding and asking the scheduler ------------------------------------------------------------


def resolve_address(address: str, run_dir: Path | None) -> str:
    """--address, else the run dir's port file, else $GRPO_SCHEDULER_ADDRESS, else DEFAULT_ADDRESS."""
    if address:
        return address
    if run_dir is not None:
        port_file = run_dir / "scheduler.port"
        port = port_file.read_text().strip() if port_file.exists() else ""
        if not port:
            raise FileNotFoundError(f"no scheduler port in {port_file} (is the run's scheduler up?)")
        return f"127.0.0.1:{port}"
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def run_security(run_dir: Path | None) -> ClientSecurity | None:
    """The run's `[security]` table (run.toml), presenting the operator certificate; None = plaintext
    (or the process default). The config, not the tls/ folder, decides: a later plain run may reuse
    a run dir where an earlier secure one left certificates."""
    config = run_dir / "run.toml" if run_dir is not None else None
    if config is None or not config.exists():
        return None
    table = tomllib.loads(config.read_text()).get("security")
    if not table:
        return None
    tls = Path(table.get("tls_ca") or run_dir / "tls" / "ca.pem").parent
    if (tls / "operator.pem").exists() and (tls / "operator.key").exists():
        table = {**table, "client_cert": tls / "operator.pem", "client_key": tls / "operator.key"}
    return ClientSecurity.from_settings(SecuritySettings(**table))


def _client(address: str, run_dir: Path | None = None) -> GrpcClient:
    """The one place the view's client is built (TLS and token of a --run-dir that has them)."""
    return GrpcClient(address, scheduler_pb2_grpc.SchedulerServiceStub, security=run_security(run_dir))


async def fetch(client: GrpcClient, timeout: float) -> Status:  # noqa: ASYNC109 (the call's deadline)
    """One GetStatus under a deadline; a failure raises the domain error (errors.py)."""
    return await client.unary("GetStatus", scheduler_pb2.GetStatusRequest(), timeout=timeout)


async def _watch(client: GrpcClient, address: str, args: StatusSettings, console: Console) -> int:
    """Refresh every --interval until Ctrl-C (the caller's 0) or, with --until-finished, the run's end."""
    last: Status | None = None
    with Live(Text(f"asking {address} ..."), console=console, auto_refresh=False) as live:
        while True:
            try:
                last = await fetch(client, args.timeout)
                live.update(render(last, address), refresh=True)
                if args.until_finished and (last.finished or last.error):
                    return 1 if last.error else 0
            except GrpoError as exc:
                live.update(unreachable(address, _reason(exc, address), last), refresh=True)
            await asyncio.sleep(args.interval)


def _from_record(run_dir: Path | None, why: str, console: Console) -> int | None:
    """Show `run_dir`'s record when it has one (exit 1 if the run failed); None when it has none."""
    if run_dir is None or not has_record(run_dir):
        return None
    try:
        record = read_record(run_dir)
    except (OSError, ValueError, sqlite3.Error) as exc:
        print(f"status: cannot read the record in {run_dir}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    console.print(render_record(record, run_dir, why))
    return 1 if record.ending == "failed" else 0


async def _main(args: StatusSettings, console: Console) -> int:
    try:
        address = resolve_address(args.address, args.run_dir)
        client = _client(address, args.run_dir)
    except (OSError, ValueError, tomllib.TOMLDecodeError) as exc:  # port file, run.toml, TLS files
        if not args.watch and not args.until_finished and isinstance(exc, FileNotFoundError):
            shown = _from_record(args.run_dir, "no scheduler port file", console)
            if shown is not None:
                return shown
        print(f"status: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    try:
        if args.watch or args.until_finished:
            return await _watch(client, address, args, console)
        try:
            status = await fetch(client, args.timeout)
        except GrpoError as exc:
            what = "is unreachable" if exc.unreachable else "refused GetStatus"
            if exc.unreachable and not args.address:
                shown = _from_record(args.run_dir, f"{address} {what}", console)
                if shown is not None:
                    return shown
            print(f"status: the scheduler at {address} {what}: {_reason(exc, address)}", file=sys.stderr)
            return 2
        console.print(render(status, address))
        return 1 if status.error else 0
    finally:
        await client.close()


def parse(argv: list[str], prog: str = PROG) -> StatusSettings:
    """The command line; SystemExit(2) on a bad one."""
    return parse_cli(StatusSettings, argv, prog)


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        return asyncio.run(_main(args, console or Console()))
    except KeyboardInterrupt:
        return 0
