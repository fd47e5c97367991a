# syntax=docker/dockerfile:1.7
# The GPU rollout worker: CUDA torch for batched inference, environment processes.
#   make image-rollout-worker                      # Crafter and gymnasium tasks
#   make image-rollout-worker WORKER_TARGET=minecraft   # + Java and MineStudio's game engine
#   make image-rollout-worker TORCH_VARIANT=cpu     # the CPU-only torch (CI, the rehearsal)
# PyPI's Linux torch wheels bundle the CUDA runtime (nvidia-* wheels); the node provides only
# the driver (NVIDIA container toolkit), so a slim Python base is enough.
# Layers: torch, the role's other pinned dependencies and Crafter's compiled world generation
# (rebuilt when pyproject.toml changes), then the package (rebuilt when the code changes: a few MB).
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
COPY pyproject.toml docker/role_requirements.py ./
# The rollout-worker role of pyproject.toml (its pins; torch is the one above): no Ray, W&B or kopf.
RUN python role_requirements.py pyproject.toml rollout-worker > requirements.txt \
 && pip install -r requirements.txt
# Crafter's world generation (numba, cache=True), compiled now into /opt/overworld/numba-cache for
# any x86-64 CPU (NUMBA_CPU_NAME=generic, set at run time too): a worker pod starts its
# environments without compiling, on a read-only root (overworld/envs/baked_numba_cache.py).
ENV NUMBA_CPU_NAME=generic
RUN SDL_VIDEODRIVER=dummy NUMBA_CACHE_DIR=/opt/overworld/numba-cache \
    python -c "import crafter; crafter.Env(seed=0).reset()"

FROM deps AS build
COPY README.md ./
COPY proto ./proto
COPY services ./services
# The package alone, built with the setuptools of the layers above (no index needed from here on),
# staged under /pkg for the runtime stage.
# hadolint ignore=DL3013
RUN pip install --no-deps --no-build-isolation --no-warn-script-location --root /pkg ".[rollout-worker]"

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
LABEL org.opencontainers.image.title="overworld-rollout-worker" \
      org.opencontainers.image.description="Overworld GPU rollout worker (CUDA torch)" \
      org.opencontainers.image.source="https://github.com/overworld-rl/overworld"
ENV PATH=/opt/overworld/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Crafter renders with pygame/SDL in software: the dummy video driver needs no display.
ENV SDL_VIDEODRIVER=dummy
# The compiled world generation baked above, found on a read-only root (a copy into $HOME's cache).
ENV NUMBA_CPU_NAME=generic NUMBA_CACHE_LOCATOR_CLASSES=overworld.envs.baked_numba_cache.BakedCacheLocator \
    OVERWORLD_NUMBA_BAKED_CACHE=/opt/overworld/numba-cache
RUN groupadd --system --gid 10001 overworld \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin overworld
COPY --from=deps /opt/overworld /opt/overworld
COPY --from=build /pkg/ /
RUN overworld --help >/dev/null
USER 10001:10001
WORKDIR /tmp
EXPOSE 50056 9090
ENTRYPOINT ["overworld"]
CMD ["serve", "rollout-worker"]

# Optional: real Minecraft through MineStudio's MinecraftSim. Java 8 (the engine's), a virtual
# display and GL for rendering, MineStudio in its own virtual environment (it pins numpy<2),
# and the game engine fetched at build time so that no pod downloads it at start.
FROM runtime AS minecraft
ARG MINESTUDIO_VERSION=
ARG TORCH_VERSION=2.13.0
USER 0
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY --from=eclipse-temurin:8-jre /opt/java/openjdk /opt/java/openjdk
ENV JAVA_HOME=/opt/java/openjdk PATH=/opt/java/openjdk/bin:/opt/minestudio/bin:$PATH
# Debian's point releases move these versions; the base image digest is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends xvfb xauth libgl1 libglu1-mesa libegl1 libxrender1 libxi6 libxtst6 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /src /src
RUN python -m venv /opt/minestudio \
 && /opt/minestudio/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
 && /opt/minestudio/bin/pip install --no-cache-dir "/src[rollout-worker,minestudio]" ${MINESTUDIO_VERSION:+"minestudio==${MINESTUDIO_VERSION}"} \
 && rm -rf /src
# MinecraftSim downloads the engine on first construction and asks yes/no on stdin: answer
# once here (a finite answer, so pipefail holds), under a virtual display, into a directory the non-root user can read.
ENV MINESTUDIO_DIR=/opt/minestudio-data
RUN mkdir -p "$MINESTUDIO_DIR" \
 && printf 'Y\nY\nY\n' | xvfb-run -a /opt/minestudio/bin/python -c "from minestudio.simulator import MinecraftSim; MinecraftSim(obs_size=(128, 128)).close()" \
 && chown -R 10001:10001 "$MINESTUDIO_DIR"
USER 10001:10001
ENTRYPOINT ["xvfb-run", "-a", "overworld"]
CMD ["serve", "rollout-worker"]
