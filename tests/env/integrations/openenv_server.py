"""The example OpenEnv server (examples/openenv_game/server.py) as a real process from `.venvs/openenv`,
for tests: started on a free port, waited for through its /health, killed by pid afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.launch.processes import die_with

ROOT = Path(__file__).resolve().parents[3]
OPENENV_PYTHON = ROOT / ".venvs" / "openenv" / "bin" / "python"
GAME = ROOT / "examples" / "openenv_game" / "server.py"
START_TIMEOUT_S = 90.0


@dataclass
class OpenEnvServer:
    url: str
    process: subprocess.Popen

    def stats(self) -> dict[str, int]:
        """The game's own counters: resets and steps it served (its GET /stats)."""
        return httpx.get(f"{self.url}/stats", timeout=10.0).json()


def require_openenv_venv() -> Path:
    """The OpenEnv virtualenv's python, or skip: `bash scripts/venv_openenv.sh` creates it."""
    if not OPENENV_PYTHON.exists():
        pytest.skip(f"{OPENENV_PYTHON.parent.parent} does not exist: run `bash scripts/venv_openenv.sh`")
    return OPENENV_PYTHON


@contextlib.contextmanager
def openenv_server(work_dir: Path) -> Iterator[OpenEnvServer]:
    """The digit-hunt OpenEnv server, running until the block ends."""
    python = require_openenv_venv()
    port_file = work_dir / "openenv.port"
    log = (work_dir / "openenv.log").open("w")
    process = subprocess.Popen(
        [str(python), str(GAME), "--port", "0", "--port-file", str(port_file)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
        preexec_fn=die_with(os.getpid()),  # SIGTERM when this test process dies without its `finally`
    )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = ""
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the OpenEnv server exited: {(work_dir / 'openenv.log').read_text()}")
            if not url and port_file.exists() and port_file.read_text().strip():
                url = f"http://127.0.0.1:{port_file.read_text().strip()}"
            if url:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                        break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the OpenEnv server did not come up in {START_TIMEOUT_S:g}s")
        yield OpenEnvServer(url=url, process=process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        log.close()
