#!/usr/bin/env bash
# Download, here, the wheels `make gpu-check` needs on the GPU image (Python 3.12, x86-64): the
# packages grpo-mesh uses that the image does not have (cryptography: the demo launcher's TLS), and
# what `bench/vs_trl.py --device cuda` adds (TRL and its datasets; transformers at this checkout's
# version, which TRL and grpo-mesh were tested with), at the versions this checkout was tested with
# (.venv, where `pip install -e '.[bench]'` put TRL). They land in .whl/ (git-ignored), which the
# device tool carries.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PIP=(.venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl)
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
for package in grpcio grpcio-health-checking grpcio-reflection protobuf pydantic pydantic-core \
    pydantic-settings annotated-types typing-inspection python-dotenv structlog tomli-w pytest-asyncio \
    cryptography cffi pycparser transformers; do
  "${PIP[@]}" "$package==$(version "$package")"
done
# bench/vs_trl.py's side: only where `.venv/bin/pip install -e '.[bench]'` installed TRL here
for package in trl datasets dill multiprocess; do
  if current=$(version "$package" 2>/dev/null); then
    "${PIP[@]}" "$package==$current"
  else
    echo "$package is not installed in .venv: the GPU check's end-to-end benchmark will lack it" >&2
  fi
done
ls -la .whl
