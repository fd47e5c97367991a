# syntax=docker/dockerfile:1.7
# The GPU rollout worker: CUDA torch for batched inference, environment processes.
#   make image-rollout-worker                      # Crafter and gymnasium tasks
#   make image-rollout-worker WORKER_TARGET=minecraft   # + Java and MineStudio's game engine
# PyPI's Linux torch wheels bundle the CUDA runtime (nvidia-* wheels); the node provides only
# the driver (NVIDIA container toolkit), so a slim Python base is enough.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/overworld
ENV PATH=/opt/overworld/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto ./proto
COPY services ./services
# The rollout-worker role of the local package (its pins in pyproject.toml): no Ray, W&B or kopf.
# hadolint ignore=DL3013
RUN pip install ".[rollout-worker]" && overworld --help >/dev/null
# Compile Crafter's world generation (numba, cache=True) now, into the image's read-only
# site-packages: a worker pod never compiles it at start.
RUN SDL_VIDEODRIVER=dummy python -c "from overworld.envs.crafter_cow import make_env; make_env().reset(seed=0)"

FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
LABEL org.opencontainers.image.title="overworld-rollout-worker" \
      org.opencontainers.image.description="Overworld GPU rollout worker (CUDA torch)" \
      org.opencontainers.image.source="https://github.com/overworld-rl/overworld"
ENV PATH=/opt/overworld/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Crafter renders with pygame/SDL in software: the dummy video driver needs no display.
ENV SDL_VIDEODRIVER=dummy
COPY --from=build /opt/overworld /opt/overworld
RUN groupadd --system --gid 10001 overworld \
 && useradd --system --uid 10001 --gid 10001 --home-dir /nonexistent --no-create-home --shell /usr/sbin/nologin overworld
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
