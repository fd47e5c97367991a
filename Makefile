# Overworld: `make run` trains the default task on this machine, `make test` runs the tests.
# Both create .venv and install what is missing on first use; `make test` first installs the Debian
# packages the tests need (as root; tests/system-packages.sh); the tests fetch the servers they need
# (redis-server, promtool) when the system has none (rehearsal/server_binaries.py), and the image tests and
# the rehearsal build the images first (make rehearsal-images; rehearsal/oci_images.py).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
CONFIG ?= examples/crafter_cow.yaml
SUMMARY ?= runs/last-summary.json
RUN_FLAGS ?=
PYTEST_ARGS ?=

SB3_STAMP := .venv-sb3/.installed-sb3-2.9.2

.PHONY: run system-packages test test-fast test-minestudio minestudio-venv rehearsal dashboard-picture bench scale sb3 lint protos install clean gpu-check gpu-wheels

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: an unpinned torch pulled in by another package would be a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# every role's dependencies (pyproject.toml: services, rollout-worker, trainer) and the tools
	$(PY) -m pip install -q -e '.[all,dev]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

# Ctrl-C stops the run: `overworld run` stops its services, writes the summary ("status": "interrupted")
# and exits 130 (cli.EXIT_INTERRUPTED), which this recipe takes for success, so make prints no
# "*** [run] Error" line. The terminal interrupts make and this shell too: the trap keeps the shell
# waiting for the run (dash would die at once, and make print "Interrupt"); make, once the recipe has
# ended, ends by SIGINT as GNU make always does when interrupted (the shell's $? is 130).
# RUN_FLAGS: more `overworld run` flags (--workdir DIR, --max-env-steps N, --insecure, ...).
run: $(STAMP)
	@trap : INT; $(VENV)/bin/overworld run $(CONFIG) --summary $(SUMMARY) $(RUN_FLAGS); rc=$$?; \
	if [ $$rc -eq 130 ]; then rc=0; fi; exit $$rc

# $(call pytest,PYTHON,ARGS): pytest exits 5 when it collected no test: that must fail, not pass quietly.
pytest = $(1) -m pytest -q $(2) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# The Debian packages of tests/debian-packages.txt: installed as root, named with the command otherwise.
system-packages:
	@tests/system-packages.sh

test: system-packages $(STAMP)
	$(call pytest,$(PY),)

test-fast: system-packages $(STAMP)
	$(call pytest,$(PY),-m "not slow")

# The cluster rehearsal (the tests in tests/rehearsal, on the harness in rehearsal/; also part of `make test`):
# the rendered chart as pods, each in network, PID, mount and UTS namespaces of its own on a bridge; pods
# deleted, workers scaled and cut off, a kubectl resume, every pod from the image its manifest names (built
# first: make rehearsal-images). Needs root, nft and an image builder; rehearsal/README.md says what it
# emulates of Kubernetes and what it does not, docs/operations.md what it covers.
rehearsal: system-packages $(STAMP)
	$(call pytest,$(PY),tests/rehearsal)

# The training dashboard in docs/operations.md, drawn from what the rehearsal's Prometheus returned for
# each of its panels (query_range, saved by tests/rehearsal/test_rehearsal.py in output/rehearsal/): run
# `make rehearsal` (or `make test`) first.
dashboard-picture: $(STAMP)
	$(PY) -m rehearsal.dashboard_picture output/rehearsal/overworld-training.json docs/images/overworld-training.png

bench: $(STAMP) $(SB3_STAMP)
	mkdir -p bench/results
	set -e; for script in bench/bench_*.py; do echo "== $$script"; $(PY) -m bench.$$(basename $$script .py); done
	$(PY) bench/report.py

# The scaling curve alone (also part of `make bench`): the scale rehearsal's fleet of 1 to 32 rollout pods
# on 200 Mbit/s links, weights by relay and by star, churn, a 30-minute soak (about 2 h; root, ~16 GB).
# SCALE_ARGS=--sizes 2,4 --soak-minutes 1 for a quick look.
scale: $(STAMP)
	$(PY) -m bench.bench_scale $(SCALE_ARGS)
	$(PY) bench/report.py
	$(PY) bench/scale_model.py

# Stable-Baselines3 for bench/bench_e2e.py's side-by-side CartPole run: a venv of its own, everything pinned,
# the CPU torch first (an unpinned torch would be a multi-GB CUDA build).
$(SB3_STAMP):
	test -x .venv-sb3/bin/python || $(PYTHON) -m venv .venv-sb3
	.venv-sb3/bin/pip install -q torch==2.13.0
	.venv-sb3/bin/pip install -q stable-baselines3==2.9.2 gymnasium==1.4.0 numpy==2.4.6
	rm -f .venv-sb3/.installed-*
	touch $@

sb3: $(SB3_STAMP)

# ruff, then mypy over services/overworld and rehearsal/ ([tool.mypy] in pyproject.toml): any error fails.
lint: $(STAMP)
	$(VENV)/bin/ruff check services tests bench docker rehearsal
	$(PY) -m mypy

protos: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=services --pyi_out=services --grpc_python_out=services proto/overworld/v1/*.proto

# MineStudio pins numpy<2 and pulls CUDA torch: it gets a venv of its own, never the main .venv.
# A plain `pip install -e '.[dev]' minestudio` backtracks through multi-GB CUDA torch builds (Overworld
# pins numpy 2 and omegaconf 2.4; MineStudio's gym3 needs numpy<2, its hydra-core omegaconf<2.4), so:
# torch 2.14.1 + torchvision 0.29.1 first (PyPI's torchvision does not import beside the 2.13.0 CPU
# torch), minestudio without its dependencies, the ones its VPT import path needs plus Overworld's
# runtime deps from .ci/minestudio-requirements.txt (ray[train] and wandb included: the quick start runs
# through every service, trainer and W&B logger too), Overworld itself without dependencies.
# The stamp skips the installs until the requirements file changes. The marked tests all live in
# tests/minestudio/ (the rest of tests/ needs ray, kubernetes tools etc. just to be collected).
minestudio-venv:
	set -e; stamp=.venv-minestudio/.installed-$$(cat .ci/minestudio-requirements.txt | sha1sum | cut -c1-12); \
	if [ ! -e $$stamp ]; then \
	  test -x .venv-minestudio/bin/python || $(PYTHON) -m venv .venv-minestudio; \
	  .venv-minestudio/bin/pip install -q torch==2.14.1 torchvision==0.29.1 'numpy<2'; \
	  .venv-minestudio/bin/pip install -q --no-deps minestudio==1.1.6; \
	  .venv-minestudio/bin/pip install -q -r .ci/minestudio-requirements.txt; \
	  .venv-minestudio/bin/pip install -q --no-deps -e .; \
	  .venv-minestudio/bin/python -c "import numpy, omegaconf, torchvision; from minestudio.models import VPTPolicy; import overworld.policies.minestudio, overworld.model_registry.server, overworld.rollout_worker.process; print('minestudio venv: numpy', numpy.__version__, 'omegaconf', omegaconf.__version__)"; \
	  rm -f .venv-minestudio/.installed-*; touch $$stamp; \
	fi

test-minestudio: minestudio-venv
	$(call pytest,.venv-minestudio/bin/python,-m minestudio tests/minestudio)

# The GPU check (docs/gpu_check.md): one device call measures every CUDA path and the Crafter recipe for
# what time is left; the doc gives the call, which runs `python3 -m bench.gpu.check` on the box (no make
# there). `make gpu-wheels` builds gpu-wheels/, the folder the call carries (needs PyPI); `make gpu-check`
# rehearses the documented call here on the stand-in box (CPU torch, tiny sizes, the box's packages only)
# and collects what it returns into runs/gpu-check-stand-in/results.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu.box_standin

gpu-wheels: $(STAMP)
	$(PY) -m bench.gpu.carry --out gpu-wheels

clean:
	rm -rf $(VENV) .venv-minestudio .venv-sb3 runs

-include docker/images.mk
