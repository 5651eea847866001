#!/usr/bin/env bash
# Create/refresh .venvs/openenv: the separate virtualenv an OpenEnv environment server runs from.
#
# Why a separate virtualenv: openenv 0.10.0 depends on fastmcp 3, which pins mcp<2, while vLLM in
# the project's .venv needs mcp>=2; installing openenv there downgrades mcp. So OpenEnv servers run
# as their own process from this venv, and grpo-mesh's adapter (services/env/integrations/openenv.py)
# speaks OpenEnv's wire protocol from .venv without importing openenv.
#
# Idempotent: a stamp file named after the hash of this script marks a finished install, so a second
# run is a no-op. OPENENV_SPEC overrides what is installed (e.g. a local wheel path).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venvs/openenv
SPEC=${OPENENV_SPEC:-openenv==0.10.0}
HASH=$( (cat scripts/venv_openenv.sh; echo "$SPEC") | sha256sum | cut -c1-16)
STAMP="$VENV/.installed-$HASH"

if [[ -f "$STAMP" && -x "$VENV/bin/python" ]]; then
  echo "venv_openenv: $VENV is up to date ($HASH)"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 10), f"need Python >= 3.10, got {sys.version}"'
  echo "venv_openenv: creating $VENV with $PYTHON"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip
"$VENV/bin/python" -m pip install "$SPEC"
"$VENV/bin/python" -c 'import openenv.core.env_server, uvicorn; from importlib.metadata import version; print("venv_openenv: openenv", version("openenv"))'
rm -f "$VENV"/.installed-*
touch "$STAMP"
echo "venv_openenv: done"
