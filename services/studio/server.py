"""Studio wiring: settings → FastAPI app (app.py) → uvicorn on 127.0.0.1.

    grpo-mesh studio [--port 7860] [--runs-root runs] [--run-dir runs/demo] [--token T]

uvicorn handles SIGTERM/SIGINT (stops accepting, finishes requests in flight); runs this studio
started are then sent SIGTERM too, and it waits for them to stop (their launchers stop their
services), so closing the studio never leaves a run's processes behind.
"""

from __future__ import annotations

import asyncio
import sys

import uvicorn

from services.common.config import parse_cli
from services.common.sockets import bind
from services.studio.app import build_app
from services.studio.config import StudioSettings

PROG = "grpo-mesh studio"
GRACE_S = 5  # on SIGTERM: requests in flight get this long


def parse(argv: list[str], prog: str = PROG) -> StudioSettings:
    return parse_cli(StudioSettings, argv, prog)


async def serve(settings: StudioSettings) -> None:
    app = build_app(settings)
    sock = bind(settings.host, settings.port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=port,
            loop="none",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=GRACE_S,  # an open page's keep-alive must not hold the exit forever
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():  # noqa: ASYNC110 (uvicorn sets a flag)
        await asyncio.sleep(0.02)
    if settings.port_file is not None and server.started:
        tmp = settings.port_file.with_name(settings.port_file.name + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(settings.port_file)
    url = f"http://{settings.host}:{port}/" + (f"?token={settings.token}" if settings.token else "")
    print(f"studio: {url}", flush=True)
    try:
        await task
    finally:
        await app.state.runs.close()
        sock.close()


def main(argv: list[str], prog: str = PROG) -> int:
    settings = parse(argv, prog)
    if settings.token_file is not None:
        settings = settings.model_copy(update={"token": settings.token_file.read_text().strip()})
    settings.runs_root.mkdir(parents=True, exist_ok=True)
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
