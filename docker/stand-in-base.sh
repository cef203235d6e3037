#!/usr/bin/env bash
# Build a STAND-IN for Flower's official image flwr/superexec:1.39.0 on a machine that cannot
# pull from a registry: a Debian 12 root file system from debootstrap, imported as an image,
# then docker/stand-in/Dockerfile on top (flwr==1.39.0, user app, the same entrypoint). It is
# not Flower's image; see the Dockerfile's header for what differs.
#
#   sudo docker/stand-in-base.sh         # prints the setting to use:
#   SUPEREXEC_IMAGE=florist-stand-in/superexec:1.39.0 docker compose build
#
# Needs root (debootstrap), docker, and debootstrap (apt-get install debootstrap). Behind a
# TLS-intercepting proxy, set PIP_CA_BUNDLE to a CA bundle that verifies it. Idempotent: the
# root file system is made once; the images are rebuilt from cache.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOTFS_IMAGE=florist-stand-in/rootfs:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if ! docker image inspect "$ROOTFS_IMAGE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || { echo "stand-in-base: debootstrap is missing (apt-get install debootstrap)" >&2; exit 2; }
    rootfs=$(mktemp -d)
    trap 'rm -rf "$rootfs"' EXIT
    echo "stand-in-base: debootstrap bookworm from $MIRROR (about a minute)" >&2
    debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >/dev/null
    tar -C "$rootfs" -c . | docker import - "$ROOTFS_IMAGE" >/dev/null
fi
ca=${PIP_CA_BUNDLE:-docker/no-extra-ca.pem}
builder=docker  # build secrets need BuildKit: the buildx plugin, or a Docker client that has it built in
if ! docker buildx version >/dev/null 2>&1 && [ -x /usr/bin/docker ]; then builder=/usr/bin/docker; fi
DOCKER_BUILDKIT=1 "$builder" build -q --secret "id=pip-ca,src=$ca" --build-arg "ROOTFS_IMAGE=$ROOTFS_IMAGE" \
    -f docker/stand-in/Dockerfile -t florist-stand-in/superexec:1.39.0 . >/dev/null
echo "SUPEREXEC_IMAGE=florist-stand-in/superexec:1.39.0"
