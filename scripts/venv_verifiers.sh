#!/usr/bin/env bash
# Create/refresh .venvs/verifiers, the virtualenv the verifiers integration runs in.
#
# verifiers 0.4.0 pins openai<3 and mcp==2.0.0, which conflict with the main .venv (vLLM), so it
# lives in its own environment and talks to grpo-mesh only over HTTP (integrations/verifiers/).
# Idempotent: a stamp file named after the hash of this script marks a finished install, so a
# second run is a no-op. VERIFIERS_SPEC overrides what is installed (e.g. a local wheel path).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venvs/verifiers
SPEC=${VERIFIERS_SPEC:-verifiers==0.4.0}
HASH=$(cat scripts/venv_verifiers.sh | sha256sum | cut -c1-16)
STAMP="$VENV/.installed-$HASH"

if [[ -f "$STAMP" && -x "$VENV/bin/python" ]]; then
  echo "venv_verifiers: $VENV is up to date ($HASH)"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), f"need Python >= 3.11, got {sys.version}"'
  echo "venv_verifiers: creating $VENV with $PYTHON"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip
# httpx: what the runner speaks to the gateway with. uv: verifiers' subprocess runtime runs its harness
# programs as uv scripts; the runner puts this bin/ on PATH, so nothing is installed into ~/.local.
"${PIP[@]}" install "$SPEC" httpx uv

"$VENV/bin/python" -c 'import verifiers, verifiers.v1; print("venv_verifiers: verifiers", verifiers.__version__)'

# verifiers' subprocess runtime runs each harness program as a PEP 723 uv script (`uv sync --script`,
# with UV_OFFLINE forced off), which would fetch the script's dependencies from PyPI at first use. Its
# chat program's dependencies, pinned to the versions this venv holds, and their closure go into
# $VENV/wheels now; the runner (integrations/verifiers/run.py) points uv there with no index
# (UV_NO_INDEX, UV_FIND_LINKS), so a run never touches the network.
SCRIPT_DEPS=$("$VENV/bin/python" - <<'PY'
import re
from importlib.metadata import version
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
block = re.search(r"# dependencies = \[(.*?)\]", CHAT_PROGRAM_SOURCE).group(1)
names = [re.split(r"[=<>!~ ]", d.strip().strip('"'))[0] for d in block.split(",") if d.strip()]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
echo "venv_verifiers: harness program dependencies: $SCRIPT_DEPS"
rm -rf "$VENV/wheels"
# shellcheck disable=SC2086
"${PIP[@]}" download -q -d "$VENV/wheels" --only-binary=:all: $SCRIPT_DEPS
# ... as a PEP 503 index (wheels/simple/<name>/), the runner's UV_DEFAULT_INDEX: this uv has no
# UV_NO_INDEX, and a local default index replaces PyPI
"$VENV/bin/python" - "$VENV/wheels" <<'PY'
import re, sys
from pathlib import Path
wheels = Path(sys.argv[1])
for wheel in sorted(wheels.glob("*.whl")):
    name = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    folder = wheels / "simple" / name
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "index.html").open("a") as page:
        page.write(f'<a href="../../{wheel.name}">{wheel.name}</a>\n')
PY
rm -f "$VENV"/.installed-*
touch "$STAMP"
echo "venv_verifiers: done"
