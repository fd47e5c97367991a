#!/usr/bin/env bash
# A stand-in for the images' base, python:3.11-slim-bookworm, for machines that cannot reach its
# registry: Debian bookworm's own packages (python3.11 with venv, CA certificates, the passwd tools
# the Dockerfiles' useradd needs), python at /usr/local/bin as in the official image, the same PATH
# and LANG, tagged under the official name so that the Dockerfiles build unchanged.
#   docker/standin-base.sh buildah|docker [IMAGE]     (make base-images calls it when a pull fails)
# Needs root and mmdebstrap (Debian: apt-get install mmdebstrap). DEBIAN_MIRROR picks the mirror.
set -euo pipefail

builder=${1:?usage: $0 buildah|docker [image]}
image=${2:-docker.io/library/python:3.11-slim-bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

command -v mmdebstrap >/dev/null || { echo "no mmdebstrap: apt-get install mmdebstrap (it builds the stand-in for $image)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

mmdebstrap --quiet --variant=apt --include=python3.11,python3.11-venv,ca-certificates,passwd \
  --customize-hook='for name in python3.11 python3 python; do ln -sf /usr/bin/python3.11 "$1/usr/local/bin/$name"; done' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*.bin' \
  bookworm "$work/rootfs.tar" "deb $mirror bookworm main"

case "$builder" in
  docker)
    docker import --change "ENV PATH=$path" --change "ENV LANG=C.UTF-8" --change 'CMD ["python3"]' \
      "$work/rootfs.tar" "$image" >/dev/null ;;
  buildah)
    container=$(buildah from scratch)
    buildah add --quiet "$container" "$work/rootfs.tar" / >/dev/null
    buildah config --env "PATH=$path" --env LANG=C.UTF-8 --cmd python3 "$container"
    buildah commit --quiet --rm "$container" "$image" >/dev/null ;;
  *) echo "unknown builder $builder (buildah or docker)" >&2; exit 1 ;;
esac
echo "built a stand-in for $image from Debian bookworm ($mirror)"
