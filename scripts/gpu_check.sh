#!/usr/bin/env bash
# `make gpu-check`: the GPU checks on a machine with an NVIDIA GPU and PyTorch (no network needed).
#
# Python packages the GPU image lacks travel as wheels in .whl/ (made here by scripts/gpu_wheels.sh,
# carried by the device tool); they are installed into /tmp/site, never into the image. Then
# scripts/gpu_check.py runs the GPU tests, the two-process cuda_ipc check and the weight-transport
# benchmark (bench/weight_transport.py --device cuda) and prints one report.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/gpu_check.py "$@"
