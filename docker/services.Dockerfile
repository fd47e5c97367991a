# syntax=docker/dockerfile:1.7
# The CPU services: rollout-manager, replay-buffer, gae, model-registry and the run-controller.
#   docker build -f docker/services.Dockerfile -t overworld-services .   (or: make image-services)
# Layers: the role's pinned dependencies (rebuilt when pyproject.toml changes), then the package
# (rebuilt when the code changes: a few MB).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/overworld
ENV PATH=/opt/overworld/bin:$PATH
WORKDIR /src
COPY pyproject.toml docker/role_requirements.py ./
# The services role only (pyproject.toml: the dependencies every role has, + the run-controller's
# kopf): no torch, Ray or W&B; the registry's half-precision cast is numpy's (core/wire/safetensors_format.py).
RUN python role_requirements.py pyproject.toml services > requirements.txt \
 && pip install -r requirements.txt \
 && python -c "import importlib.util as u; assert not [m for m in ('torch', 'ray', 'wandb') if u.find_spec(m)]"

FROM deps AS build
COPY README.md ./
COPY proto ./proto
COPY services ./services
# The package alone, built with the setuptools of the layer above (no index needed from here on),
# staged under /pkg for the runtime stage.
# hadolint ignore=DL3013
RUN pip install --no-deps --no-build-isolation --no-warn-script-location --root /pkg ".[services]"

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
LABEL org.opencontainers.image.title="overworld-services" \
      org.opencontainers.image.description="Overworld CPU services: rollout-manager, replay-buffer, gae, model-registry, run-controller" \
      org.opencontainers.image.source="https://github.com/overworld-rl/overworld"
ENV PATH=/opt/overworld/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
# A fixed numeric non-root user, so that Kubernetes can verify runAsNonRoot.
RUN groupadd --system --gid 10001 overworld \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin overworld
COPY --from=deps /opt/overworld /opt/overworld
COPY --from=build /pkg/ /
RUN overworld --help >/dev/null
USER 10001:10001
WORKDIR /tmp
# 50051-50054: the services' gRPC ports; 9090: /metrics; 8080: the run-controller's liveness.
EXPOSE 50051 50052 50053 50054 9090 8080
ENTRYPOINT ["overworld"]
CMD ["--help"]
