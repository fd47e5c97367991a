# Image builds (included by the Makefile): make images, or one of image-services,
# image-rollout-worker, image-trainer. Each installs its role of pyproject.toml (`.[services]`,
# `.[rollout-worker]`, `.[trainer]`); torch and Ray versions are read from there so that the GPU
# images carry exactly the pinned torch (a CUDA build, installed first) and the Ray of their base.
#   make images REGISTRY=registry.example.com/rl TAG=0.1.0
#   make image-rollout-worker WORKER_TARGET=minecraft   # + Java and MineStudio's engine
#   make images DOCKER="docker buildx" BUILD_FLAGS="--platform linux/amd64 --push"

DOCKER ?= docker
BUILD_FLAGS ?=
REGISTRY ?= ghcr.io/overworld-rl
TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
WORKER_TARGET ?= runtime
pin = $(shell sed -n 's/.*"$(1)\(\[[^]]*\]\)\{0,1\}==\([^"]*\)".*/\2/p' pyproject.toml | head -1)
TORCH_VERSION := $(call pin,torch)
RAY_VERSION := $(call pin,ray)

.PHONY: images image-services image-rollout-worker image-trainer image-versions

images: image-services image-rollout-worker image-trainer

image-versions:
	@test -n "$(TORCH_VERSION)" || { echo "no torch==X pin in pyproject.toml" >&2; exit 1; }
	@test -n "$(RAY_VERSION)" || { echo "no ray==X pin in pyproject.toml" >&2; exit 1; }
	@echo "tag $(TAG): torch $(TORCH_VERSION), ray $(RAY_VERSION)"

image-services: image-versions
	$(DOCKER) build $(BUILD_FLAGS) -f docker/services.Dockerfile \
	  -t $(REGISTRY)/overworld-services:$(TAG) .

image-rollout-worker: image-versions
	$(DOCKER) build $(BUILD_FLAGS) -f docker/rollout-worker.Dockerfile --target $(WORKER_TARGET) \
	  --build-arg TORCH_VERSION=$(TORCH_VERSION) \
	  -t $(REGISTRY)/overworld-rollout-worker:$(TAG)$(if $(filter minecraft,$(WORKER_TARGET)),-minecraft) .

image-trainer: image-versions
	$(DOCKER) build $(BUILD_FLAGS) -f docker/trainer.Dockerfile \
	  --build-arg TORCH_VERSION=$(TORCH_VERSION) --build-arg RAY_VERSION=$(RAY_VERSION) \
	  -t $(REGISTRY)/overworld-trainer:$(TAG) .
