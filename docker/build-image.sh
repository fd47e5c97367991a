#!/usr/bin/env bash
# Builds one image from the repository root with a standard OCI builder (make images calls it):
#   docker/build-image.sh DOCKERFILE TARGET IMAGE [--build-arg NAME=VALUE ...]
# CONTEXT: the build context (default: the repository root, filtered by .dockerignore).
# BUILDER=docker: `$DOCKER build` (DOCKER, default docker; BUILD_FLAGS passed on).
# BUILDER=buildah: `buildah bud --layers --isolation chroot` (no daemon, no OCI runtime). Where pip
#   here is configured (an index mirror, a wheel directory, a CA: docker/pip_config_mounts.py), the
#   stages that fetch from an index (up to the one named `deps`) are built first with that
#   configuration mounted, then the image from their cached layers without it, so that no mount
#   point is left in the image.
# BUILDER=auto (default): docker when its daemon answers, else buildah.
set -euo pipefail

dockerfile=${1:?usage: $0 DOCKERFILE TARGET IMAGE [BUILD ARGS]}
target=${2:?}
image=${3:?}
shift 3
read -r -a flags <<<"${BUILD_FLAGS:-}"
context=${CONTEXT:-.}

builder=${BUILDER:-auto}
if [ "$builder" = auto ]; then
  if docker info >/dev/null 2>&1; then builder=docker
  elif command -v buildah >/dev/null 2>&1; then builder=buildah
  else echo "no image builder: install Docker, or buildah (Debian: apt-get install buildah)" >&2; exit 1
  fi
fi

# The base of every stage: pulled, or where its registry cannot be reached, a stand-in built once.
base=docker.io/library/python:3.11-slim-bookworm
have_base() {
  case "$builder" in
    docker) docker image inspect "$base" || timeout 300 docker pull -q "$base" ;;
    *) buildah inspect --type image "$base" || timeout 300 buildah pull -q "$base" ;;
  esac >/dev/null 2>&1
}
(
  flock 9
  if ! have_base; then
    echo "$base: not here and its registry cannot be reached; building a stand-in (docker/standin-base.sh)" >&2
    docker/standin-base.sh "$builder" "$base"
  fi
) 9>"${TMPDIR:-/tmp}/overworld-base-image-$(id -u).lock"

case "$builder" in
  docker)
    read -r -a docker <<<"${DOCKER:-docker}"
    exec "${docker[@]}" build "${flags[@]}" -f "$dockerfile" --target "$target" "$@" -t "$image" "$context" ;;
  buildah)
    bud=(buildah bud --layers --isolation chroot "${flags[@]}" -f "$dockerfile" "$@")
    read -r -a pip_mounts <<<"$(python3 docker/pip_config_mounts.py "${TMPDIR:-/tmp}/overworld-pip-config-$(id -u)")"
    if [ ${#pip_mounts[@]} -gt 0 ] && grep -qiE '^FROM .* AS deps[[:space:]]*$' "$dockerfile"; then
      "${bud[@]}" "${pip_mounts[@]}" --target deps "$context"
    fi
    exec "${bud[@]}" --target "$target" -t "$image" "$context" ;;
  *) echo "BUILDER is auto, docker or buildah, not $builder" >&2; exit 1 ;;
esac
