#!/usr/bin/env bash
# Make a Debian bookworm base image locally, for machines that cannot pull `python:3.11-slim` (no
# registry reachable) but can reach a Debian package archive:
#
#   scripts/local-base-image.sh [TAG]        # default TAG: grpo-mesh/base:bookworm
#   docker compose build --build-arg BASE_IMAGE=grpo-mesh/base:bookworm   (or GRPO_BASE_IMAGE=... make up)
#
# debootstrap (minbase) builds the root filesystem; `docker import` turns it into an image. Bookworm's
# python3 is 3.11, the version the wheels are built for; python3-venv gives the image's build stage a
# virtualenv. Idempotent: an existing TAG is kept unless REBUILD=1. MIRROR picks the archive.
set -euo pipefail

TAG=${1:-grpo-mesh/base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

if [[ -z ${REBUILD:-} ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "local-base-image: $TAG exists (REBUILD=1 to make it again)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "local-base-image: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR"
cat > "$root/etc/apt/sources.list" <<SOURCES
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
SOURCES
# what an image does not need: package caches, lists, docs and manuals (the way the official images trim)
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" --numeric-owner -c . \
  | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$TAG"
docker image ls "$TAG"
