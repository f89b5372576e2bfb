#!/usr/bin/env bash
# Build the image's base from Debian's own packages (no container registry needed): a minimal
# bookworm root filesystem (its python3 is 3.11, the project's Python) made with debootstrap and
# imported into podman as $BASE_IMAGE. Idempotent: does nothing when the image exists (FORCE=1 rebuilds).
#
#   MIRROR=URL     Debian mirror (default: debootstrap's own default)
#   ROOTFS=DIR     where the tree is built (default deploy/base-rootfs, gitignored; removed after import
#                  unless KEEP_ROOTFS=1)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BASE_IMAGE="${BASE_IMAGE:-localhost/gret-serve-base:bookworm}"
SUITE=bookworm
ROOTFS="${ROOTFS:-$ROOT/deploy/base-rootfs}"
MIRROR="${MIRROR:-}"
# python3-venv: the builder stage makes the venv with it; ca-certificates: TLS. No libgomp1: the
# wheels that use OpenMP (torch, sentencepiece) bundle their own copy (checked with ldd).
PACKAGES=python3,python3-venv,ca-certificates

if [[ "${FORCE:-0}" != 1 ]] && podman image exists "$BASE_IMAGE"; then
    echo "base: $BASE_IMAGE already exists (FORCE=1 to rebuild)"
    exit 0
fi

# debootstrap and podman import need root (device nodes, ownership); use sudo where there is one.
SUDO=()
if [[ "$(id -u)" != 0 ]]; then
    command -v sudo > /dev/null || { echo "base: run as root or install sudo" >&2; exit 1; }
    SUDO=(sudo)
fi
if ! command -v debootstrap > /dev/null; then
    "${SUDO[@]}" apt-get update -qq
    "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
fi

# A half-built tree from an interrupted run is not trusted: start over.
"${SUDO[@]}" rm -rf "$ROOTFS"
mkdir -p "$(dirname "$ROOTFS")"
# shellcheck disable=SC2086  # MIRROR is intentionally dropped when empty
"${SUDO[@]}" debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" $MIRROR

# Slim the tree: package lists, caches, docs and man pages are of no use at run time
# (a derived image runs apt-get update first anyway).
"${SUDO[@]}" rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/* "$ROOTFS"/var/cache/debconf/*-old \
    "$ROOTFS"/var/log/* "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
    "$ROOTFS"/tmp/* "$ROOTFS"/root/.cache

"${SUDO[@]}" tar --numeric-owner -C "$ROOTFS" -c . | "${SUDO[@]}" podman import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "debian $SUITE minbase + $PACKAGES (deploy/build-local-base.sh)" \
    - "$BASE_IMAGE"

if [[ "${KEEP_ROOTFS:-0}" != 1 ]]; then
    "${SUDO[@]}" rm -rf "$ROOTFS"
fi
"${SUDO[@]}" podman image ls "$BASE_IMAGE"
