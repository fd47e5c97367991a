# syntax=docker/dockerfile:1.7
# The PPO trainer, run by KubeRay (RayJob) on the head and GPU worker pods.
#   make image-trainer                      # CUDA torch
#   make image-trainer TORCH_VARIANT=cpu    # the CPU-only torch (CI, the rehearsal)
# The same slim Python base as the other images, with Ray from PyPI at exactly the version pinned in
# pyproject.toml (the chart's trainer.rayVersion, KubeRay's rayVersion, comes from the same pin).
# KubeRay runs any image whose `ray` matches rayVersion and that has bash and wget (its generated
# command and default probes); the rayproject/ray GPU image would add its own CUDA libraries next to
# the ones torch's wheels bundle, a second Python, and a registry these builds may not reach
# (docs/operations.md, "Images").
# Layers: torch and the role's other pinned dependencies (rebuilt when pyproject.toml changes), then
# the package (rebuilt when the code changes: a few MB).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS deps
ARG TORCH_VERSION=2.13.0
# cuda: PyPI's torch (bundles CUDA), "===" so that no local +cpu build a wheel directory offers counts;
# cpu: PyTorch's CPU-only build (TORCH_CPU_INDEX_URL, "" where pip's configuration already finds it).
# torch is pinned (TORCH_VERSION; hadolint does not read "+cpu")
ARG TORCH_VARIANT=cuda
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/overworld
ENV PATH=/opt/overworld/bin:$PATH
WORKDIR /src
# hadolint ignore=DL3013
RUN case "${TORCH_VARIANT}" in \
      cuda) pip install "torch===${TORCH_VERSION}" \
         && python -c "import sys, torch; sys.exit(torch.version.cuda is None and 'a CPU-only torch: TORCH_VARIANT=cpu?')" ;; \
      cpu) pip install "torch==${TORCH_VERSION}+cpu" ${TORCH_CPU_INDEX_URL:+--extra-index-url "${TORCH_CPU_INDEX_URL}"} ;; \
      *) echo "TORCH_VARIANT is cuda or cpu, not ${TORCH_VARIANT}" >&2; exit 1 ;; \
    esac
# Up to here the same as the rollout worker's: a builder with a layer cache builds torch's layer once.
ARG RAY_VERSION=2.60.0
COPY pyproject.toml docker/role_requirements.py ./
# The trainer role of pyproject.toml (its pins; torch is the one above): Ray Train, W&B, TensorBoard.
RUN python role_requirements.py pyproject.toml trainer > requirements.txt \
 && pip install -r requirements.txt \
 && python -c "import ray; assert ray.__version__ == '${RAY_VERSION}', ray.__version__"

FROM deps AS build
COPY README.md ./
COPY proto ./proto
COPY services ./services
# The package alone, built with the setuptools of the layers above (no index needed from here on),
# staged under /pkg for the runtime stage.
# hadolint ignore=DL3013
RUN pip install --no-deps --no-build-isolation --no-warn-script-location --root /pkg ".[trainer]"

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
LABEL org.opencontainers.image.title="overworld-trainer" \
      org.opencontainers.image.description="Overworld PPO trainer on Ray Train (KubeRay RayJob)" \
      org.opencontainers.image.source="https://github.com/overworld-rl/overworld"
ENV PATH=/opt/overworld/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# KubeRay's default readiness and liveness probes run `wget ... | grep success` under bash.
# Debian's point releases move its version; the base image digest is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/*
# The user of the rayproject images, "ray" (uid 1000, gid 100 "users"), with a home Ray writes to:
# the run-controller's RayJob pods run as 1000:100 (run_controller/rayjob.py).
RUN useradd --uid 1000 --gid 100 --create-home --home-dir /home/ray --shell /bin/bash ray
COPY --from=deps /opt/overworld /opt/overworld
COPY --from=build /pkg/ /
RUN overworld --help >/dev/null
USER 1000:100
WORKDIR /home/ray
EXPOSE 50055 9090 6379 8265 10001
