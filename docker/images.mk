# Image builds (included by the Makefile): make images, or one of image-services,
# image-rollout-worker, image-trainer. Each installs its role of pyproject.toml (`.[services]`,
# `.[rollout-worker]`, `.[trainer]`) at its pins; torch and Ray versions are read from there.
#   make images REGISTRY=registry.example.com/rl TAG=0.1.0
#   make images TORCH_VARIANT=cpu                       # the CPU-only torch (CI, the cluster rehearsal)
#   make image-rollout-worker WORKER_TARGET=minecraft   # + Java and MineStudio's engine
#   make images BUILDER=docker DOCKER="docker buildx" BUILD_FLAGS="--platform linux/amd64 --push"
# BUILDER (docker/build-image.sh): docker when its daemon answers, else buildah. A base image that can
# be neither found nor pulled is built as a stand-in from Debian's packages (docker/standin-base.sh).

BUILDER ?= auto
DOCKER ?= docker
BUILD_FLAGS ?=
REGISTRY ?= ghcr.io/overworld-rl
TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)
WORKER_TARGET ?= runtime
TORCH_VARIANT ?= cuda
TORCH_CPU_INDEX_URL ?= https://download.pytorch.org/whl/cpu
pin = $(shell sed -n 's/.*"$(1)\(\[[^]]*\]\)\{0,1\}==\([^"]*\)".*/\2/p' pyproject.toml | head -1)
TORCH_VERSION := $(call pin,torch)
RAY_VERSION := $(call pin,ray)
MOTO_VERSION := $(call pin,moto)
build_image = BUILDER=$(BUILDER) DOCKER="$(DOCKER)" BUILD_FLAGS="$(BUILD_FLAGS)" docker/build-image.sh
torch_args = --build-arg TORCH_VERSION=$(TORCH_VERSION) --build-arg TORCH_VARIANT=$(TORCH_VARIANT) \
	  --build-arg TORCH_CPU_INDEX_URL=$(TORCH_CPU_INDEX_URL)
# The rehearsal's stand-ins for the chart's third-party images (rehearsal/{object-store,redis}.Dockerfile).
REHEARSAL_OBJECT_STORE ?= localhost/overworld-rehearsal/object-store:moto-$(MOTO_VERSION)
REHEARSAL_REDIS ?= localhost/overworld-rehearsal/redis:bookworm
# The scale rehearsal's rollout-worker and trainer: the images with its stand-in env (rehearsal/scale_standin.py).
SCALE_IMAGES ?= localhost/overworld-scale

.PHONY: images image-services image-rollout-worker image-trainer image-versions rehearsal-images scale-images

images: image-services image-rollout-worker image-trainer

image-versions:
	@test -n "$(TORCH_VERSION)" || { echo "no torch==X pin in pyproject.toml" >&2; exit 1; }
	@test -n "$(RAY_VERSION)" || { echo "no ray==X pin in pyproject.toml" >&2; exit 1; }
	@echo "tag $(TAG): torch $(TORCH_VERSION) ($(TORCH_VARIANT)), ray $(RAY_VERSION)"

image-services: image-versions
	$(build_image) docker/services.Dockerfile runtime $(REGISTRY)/overworld-services:$(TAG)

image-rollout-worker: image-versions
	$(build_image) docker/rollout-worker.Dockerfile $(WORKER_TARGET) \
	  $(REGISTRY)/overworld-rollout-worker:$(TAG)$(if $(filter minecraft,$(WORKER_TARGET)),-minecraft) $(torch_args)

image-trainer: image-versions
	$(build_image) docker/trainer.Dockerfile runtime $(REGISTRY)/overworld-trainer:$(TAG) \
	  $(torch_args) --build-arg RAY_VERSION=$(RAY_VERSION)

# What `make test` runs (rehearsal/oci_images.py builds it, the three images with the CPU-only torch under
# names of their own): the images, and the stand-ins for the object store and Redis.
rehearsal-images: images
	CONTEXT=rehearsal $(build_image) rehearsal/object-store.Dockerfile runtime \
	  $(REHEARSAL_OBJECT_STORE) --build-arg MOTO_VERSION=$(MOTO_VERSION)
	CONTEXT=rehearsal $(build_image) rehearsal/redis.Dockerfile runtime $(REHEARSAL_REDIS)

# What `make scale` runs (bench/bench_scale.py): the rehearsal's images, and the rollout-worker and the
# trainer with the scale rehearsal's stand-in environment added (rehearsal/scale-standin.Dockerfile).
scale-images: rehearsal-images
	CONTEXT=rehearsal $(build_image) rehearsal/scale-standin.Dockerfile runtime \
	  $(SCALE_IMAGES)/overworld-rollout-worker:$(TAG) --build-arg BASE=$(REGISTRY)/overworld-rollout-worker:$(TAG)
	CONTEXT=rehearsal $(build_image) rehearsal/scale-standin.Dockerfile runtime \
	  $(SCALE_IMAGES)/overworld-trainer:$(TAG) --build-arg BASE=$(REGISTRY)/overworld-trainer:$(TAG)
