# Sourced by install.sh and install-official.sh: the steps every vLLM environment shares.
# Needs VENV, PYTHON, STAMP and ROOT set; defines ts, PIP and start.
#
# venv_begin MESSAGE   exit 0 if STAMP is newer than pyproject.toml (installed), else print
#                      MESSAGE, create VENV if missing, and upgrade pip (plus any extra args)
# venv_done            touch STAMP and print the time and size

ts() { date +%H:%M:%S; }

venv_begin() {
  local message=$1
  shift
  if [[ -f $STAMP && $STAMP -nt $ROOT/pyproject.toml ]]; then
    exit 0
  fi
  start=$(date +%s)
  echo "==> [$(ts)] $message"
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
  "${PIP[@]}" install --quiet --upgrade pip "$@"
}

venv_done() {
  touch "$STAMP"
  echo "==> [$(ts)] $VENV ready in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
}
