#!/usr/bin/env bash
# The base of the CPU image, made here rather than pulled: a Debian bookworm root filesystem
# (debootstrap, from any Debian mirror: an internal one on an air-gapped network) imported into
# the local Docker daemon as specserve-base:bookworm. Needs root, debootstrap and a running dockerd.
#
#   scripts/make_base_image.sh [MIRROR]        default MIRROR: http://deb.debian.org/debian
#
# bookworm's python3 is 3.11, the Python of the CPU torch wheel; libpython3.11 is the shared
# library Triton's Python backend stub links; python3-venv because Debian's own python refuses
# `pip install` outside a virtual environment (PEP 668). The one command it runs is, by hand:
#   debootstrap --variant=minbase --include=python3,python3-venv,libpython3.11,ca-certificates \
#     bookworm rootfs MIRROR && tar -C rootfs -c . | docker import - specserve-base:bookworm
set -euo pipefail
MIRROR=${1:-http://deb.debian.org/debian}
IMAGE=${BASE_IMAGE:-specserve-base:bookworm}
ROOTFS=$(mktemp -d)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,libpython3.11,ca-certificates \
    bookworm "$ROOTFS" "$MIRROR"
# What a container does not need: the package lists and the downloaded packages.
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb
tar -C "$ROOTFS" -c . | docker import - "$IMAGE"
docker image inspect --format '{{.RepoTags}} {{.Size}} bytes' "$IMAGE"
