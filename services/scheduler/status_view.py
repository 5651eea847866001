"""`python -m services.scheduler status`: a run at a glance in the terminal, from GetStatus.

    python -m services.scheduler status --address 127.0.0.1:50050           # once
    python -m services.scheduler status --run-dir runs/demo --watch         # live, until Ctrl-C

One table for the run (step, versions, rates, reward, loss, staleness, alignment, last sync phases,
errors), one for queues and groups, one for the rollouts (version, load, health; a rollout behind
the learner is shown in yellow, an unhealthy one in red). `--run-dir` finds the scheduler through
the port file the launcher writes (`<run_dir>/scheduler.port`) and uses the run's TLS material and
token when `make demo ARGS="--secure true"` made them (`<run_dir>/tls/`). Exit codes: 0 shown (or
the run finished, with --until-finished), 1 the run failed, 2 the scheduler is unreachable.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from grpo.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.clients import GrpcClient
from services.common.errors import GrpoError
from services.common.security import ClientSecurity, SecuritySettings

DEFAULT_ADDRESS = "127.0.0.1:50050"  # the scheduler's port in compose and the docs


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def run_table(s: scheduler_pb2.GetStatusResponse, address: str) -> Table:
    table = Table(title=f"grpo-mesh run @ {address}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    progress = f"{s.step}/{s.max_steps} ({s.step / s.max_steps:.0%})" if s.max_steps else f"{s.step}"
    state = (
        "[red]failed[/]" if s.error else "finished" if s.finished else "paused" if s.paused else "training"
    )
    sync = s.last_sync
    rows = [
        ("state", state),
        ("step", progress),
        ("learner version", str(s.learner_version)),
        ("steps/s", f"{s.steps_per_second:.2f}"),
        ("tokens/s", f"{s.tokens_per_second:.0f}"),
        ("reward (last step)", f"{s.reward_mean:.4f}"),
        ("loss (last step)", f"{s.loss:.5f}"),
        ("staleness (mean)", f"{s.staleness_mean:.2f}"),
        ("alignment |Δ logprob|", f"{s.logprob_abs_diff_max:.2e}"),
        (
            "last sync",
            f"{sync.total_ms:.1f} ms (prepare {sync.prepare_ms:.1f} · stage {sync.stage_ms:.1f} · "
            f"commit {sync.commit_ms:.1f}) via {s.weight_transport or '?'}",
        ),
        ("uptime", _duration(s.uptime_seconds)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    if s.error:
        table.add_row("error", Text(s.error, style="red"))
    return table


def queue_table(s: scheduler_pb2.GetStatusResponse) -> Table:
    table = Table(title="queues and groups", title_justify="left")
    table.add_column("name")
    table.add_column("count", justify="right")
    for name, depth in sorted(s.queue_depths.items()):
        table.add_row(f"queue {name}", str(depth))
    for state, count in sorted(s.groups_by_state.items()):
        table.add_row(f"groups {state}", str(count))
    return table


def rollout_table(s: scheduler_pb2.GetStatusResponse) -> Table:
    table = Table(title=f"rollouts ({len(s.rollouts)})", title_justify="left")
    for column in ("rollout", "address", "version", "load", "healthy"):
        table.add_column(column)
    for r in s.rollouts:
        style = "red" if not r.healthy else "yellow" if r.weight_version != s.learner_version else ""
        table.add_row(
            r.rollout_id or "?",
            r.address,
            str(r.weight_version),
            f"{r.in_flight}/{r.max_in_flight}",
            "✓" if r.healthy else "✗",
            style=style,
        )
    return table


def render(status: scheduler_pb2.GetStatusResponse, address: str) -> Group:
    """The whole view (pure: tests render it to text)."""
    return Group(run_table(status, address), queue_table(status), rollout_table(status))


def _client(address: str, run_dir: Path | None) -> GrpcClient:
    """The one place the view's client is built: with the run's TLS and token when it has them."""
    security = None
    tls = run_dir / "tls" if run_dir is not None else None
    if tls is not None and (tls / "ca.pem").exists():
        security = ClientSecurity.from_settings(
            SecuritySettings(
                tls_ca=tls / "ca.pem",
                client_cert=tls / "operator.pem",
                client_key=tls / "operator.key",
                token_file=tls / "token",
            )
        )
    return GrpcClient(address, scheduler_pb2_grpc.SchedulerServiceStub, security=security)


async def fetch(client: GrpcClient, timeout: float) -> scheduler_pb2.GetStatusResponse:  # noqa: ASYNC109
    return await client.unary("GetStatus", scheduler_pb2.GetStatusRequest(), timeout)


async def _watch(client: GrpcClient, address: str, args: argparse.Namespace, console: Console) -> int:
    with Live(Text(f"connecting to {address} ..."), console=console, refresh_per_second=4) as live:
        while True:
            try:
                status = await fetch(client, args.timeout)
                live.update(render(status, address))
                if args.until_finished and (status.finished or status.error):
                    return 1 if status.error else 0
            except GrpoError as exc:
                live.update(Text(f"scheduler {address} unreachable: {exc} (retrying)", style="red"))
            await asyncio.sleep(args.interval)


async def _main(args: argparse.Namespace, console: Console) -> int:
    address = args.address
    if args.run_dir is not None and not address:
        port_file = args.run_dir / "scheduler.port"
        if not port_file.exists():
            print(f"error: no scheduler port file in {args.run_dir}", file=sys.stderr)
            return 2
        address = f"127.0.0.1:{port_file.read_text().strip()}"
    address = address or os.environ.get("GRPO_SCHEDULER_ADDRESS", DEFAULT_ADDRESS)
    client = _client(address, args.run_dir)
    try:
        if args.watch:
            return await _watch(client, address, args, console)
        try:
            status = await fetch(client, args.timeout)
        except GrpoError as exc:
            print(f"error: scheduler {address} unreachable: {exc}", file=sys.stderr)
            return 2
        console.print(render(status, address))
        return 1 if status.error else 0
    finally:
        await client.close()


def main(argv: list[str] | None = None, console: Console | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.scheduler status", description="A run at a glance, from GetStatus."
    )
    parser.add_argument("--address", default="", help="scheduler host:port (default $GRPO_SCHEDULER_ADDRESS)")
    parser.add_argument(
        "--run-dir", type=Path, default=None, help="find the scheduler (and TLS) of a demo run"
    )
    parser.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    parser.add_argument("--until-finished", action="store_true", help="with --watch: stop when the run ends")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    parser.add_argument("--timeout", type=float, default=5.0, help="deadline of each GetStatus call")
    args = parser.parse_args(argv)
    try:
        return asyncio.run(_main(args, console or Console()))
    except KeyboardInterrupt:
        return 0
