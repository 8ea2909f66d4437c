#!/usr/bin/env bash
# Install one environment exactly as locked: every package at the version and hash its lock
# names, nothing resolved on the day, packages the lock does not name removed; then Slipstream
# itself, editable, with the locked build tools (no build isolation, so nothing unlocked is
# fetched to build it).
#
# usage: hack/lock/install.sh VENV LOCK [LOCK...]
#   e.g. hack/lock/install.sh .venv locks/venv.txt
# Installs with uv (from locks/tools.txt, itself installed hash-checked by pip), which
# downloads in parallel and caches under ~/.cache/uv. The locks are refreshed by `make lock`.
set -euo pipefail

[[ $# -ge 2 ]] || { sed -n '2,10p' "$0" >&2; exit 2; }
VENV=$1; shift
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=hack/lock/pins.sh
source "$ROOT/hack/lock/pins.sh"
start=$(date +%s)
ts() { date +%H:%M:%S; }

free=$(df -Pk "$ROOT" | awk 'NR==2 {print int($4 / 1048576)}')
if [[ $free -lt 10 ]]; then
  echo "==> warning: $free GiB free on this disk; an environment with torch needs up to 10 GiB" >&2
fi
ensure_tools
UV=$(tools_venv)/bin/uv
test -x "$VENV/bin/python" || "${PYTHON:-python3}" -m venv "$VENV"
echo "==> [$(ts)] $VENV from $* (uv pip sync, hash-checked)"
# --compile-bytecode: write every package's .pyc now. Without it nothing is ever cached where
# PYTHONDONTWRITEBYTECODE is set, and each process that imports vLLM compiles vLLM, torch and
# transformers from source again: 28 s against 8 s per import on a 2-core host, and a
# `vllm serve` start imports vLLM in three processes.
"$UV" pip sync --quiet --require-hashes --compile-bytecode --python "$VENV/bin/python" "$@"
"$UV" pip install --quiet --no-deps --no-build-isolation --python "$VENV/bin/python" -e "$ROOT"
echo "==> [$(ts)] $VENV ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
