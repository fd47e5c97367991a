# syntax=docker/dockerfile:1.7
# The PPO trainer, run by KubeRay (RayJob) on the head and GPU worker pods. Based on the Ray
# image of exactly the Ray version pinned in pyproject.toml, so that the cluster and the
# driver agree (KubeRay's rayVersion comes from the same pin: trainer.rayVersion).
#   make image-trainer
ARG RAY_VERSION=2.60.0
ARG RAY_IMAGE_SUFFIX=-py311-gpu
FROM rayproject/ray:${RAY_VERSION}${RAY_IMAGE_SUFFIX}
ARG TORCH_VERSION=2.13.0
ARG RAY_VERSION
LABEL org.opencontainers.image.title="overworld-trainer" \
      org.opencontainers.image.description="Overworld PPO trainer on Ray Train (KubeRay RayJob)" \
      org.opencontainers.image.source="https://github.com/overworld-rl/overworld"
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# The Ray image runs as user "ray" (uid 1000, gid 100) with its own Python environment.
WORKDIR /home/ray/overworld
COPY --chown=1000:100 pyproject.toml README.md ./
COPY --chown=1000:100 proto ./proto
COPY --chown=1000:100 services ./services
# Ray itself must stay the image's version: installing the package (the trainer role of
# pyproject.toml) with that pin as a constraint fails loudly instead of swapping Ray underneath KubeRay.
RUN echo "ray==${RAY_VERSION}" > /tmp/constraints.txt \
 && pip install "torch==${TORCH_VERSION}" -c /tmp/constraints.txt \
 && pip install ".[trainer]" -c /tmp/constraints.txt \
 && python -c "import ray, overworld; assert ray.__version__ == '${RAY_VERSION}', ray.__version__" \
 && rm -rf /home/ray/overworld /tmp/constraints.txt
WORKDIR /home/ray
# Numeric, so that Kubernetes can verify runAsNonRoot (the run-controller sets runAsUser 1000).
USER 1000:100
EXPOSE 50055 9090 6379 8265 10001
