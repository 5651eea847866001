#!/usr/bin/env bash
# The ecosystem integrations (docs/ecosystem.md); `make integrations` (and `make test`) call this.
#
#   atropos    atroposlib into .venv (no pin of it conflicts with ours): the `atropos` extra
#   OpenEnv    the adapter's client side into .venv (the `openenv` extra); openenv itself, whose fastmcp
#              pins mcp<2 while vLLM needs mcp>=2, into its own .venvs/openenv (scripts/venv_openenv.sh)
#   verifiers  its own .venvs/verifiers (it pins openai<3 and mcp==2.0.0; scripts/venv_verifiers.sh):
#              the runner (integrations/verifiers/) talks to grpo-mesh over HTTP only
#   chromium   Debian's, for the studio's browser test (tests/studio), when missing and this runs as
#              root with apt-get; otherwise (or if apt fails) that test skips and says how to get it
#
# None of them is needed by `make demo`. Idempotent: a stamp named after pyproject.toml and this script
# marks the extras installed; the two venv scripts keep stamps of their own.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
HASH=$(cat pyproject.toml scripts/install_integrations.sh | sha256sum | cut -c1-16)
STAMP="$VENV/.integrations-$HASH"
if [[ ! -f "$STAMP" ]]; then
  "$VENV/bin/python" -m pip install -e '.[atropos,openenv]'
  "$VENV/bin/python" -c 'import atroposlib, websockets; print("integrations: atroposlib and the OpenEnv client in .venv")'
  rm -f "$VENV"/.integrations-*
  touch "$STAMP"
fi
if ! command -v chromium >/dev/null && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  echo "integrations: installing Debian's chromium (the studio's browser test)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1; } \
    || echo "integrations: warning: chromium did not install; tests/studio's browser test will skip"
fi
bash scripts/venv_openenv.sh
bash scripts/venv_verifiers.sh
