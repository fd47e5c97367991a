# The rehearsal's stand-in for the chart's Redis image (docker.io/library/redis, unreachable from these
# machines): Debian's redis-server and redis-cli, as user redis with the official image's uid and gid
# (999), which the chart's securityContext names. The chart's command (/bin/sh, redis-server) and its
# probes (redis-cli ping) run in it unchanged. Built by `make rehearsal-images`.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
# Debian's point releases move its version; the base image digest is the pin.
# hadolint ignore=DL3008
RUN groupadd --system --gid 999 redis \
 && useradd --system --uid 999 --gid 999 --home-dir /data --no-create-home redis \
 && apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/*
USER 999:999
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]
