#!/usr/bin/env bash
# Copy the generated CRDs (crds/, written by `make crds` from the API models) into the
# Helm chart (charts/slipstream/files/crds/), byte for byte. The chart renders them as
# templates so that `helm upgrade` upgrades them; tests/unit/test_chart.py fails when the
# two folders differ. Usage: hack/sync-chart-crds.sh [--check]
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
src="$repo/crds"
dst="$repo/charts/slipstream/files/crds"

if [[ "${1:-}" == "--check" ]]; then
  if diff -r "$src" "$dst" >/dev/null 2>&1; then
    echo "chart CRDs are in sync with crds/"
    exit 0
  fi
  echo "charts/slipstream/files/crds differs from crds/: run hack/sync-chart-crds.sh" >&2
  diff -r "$src" "$dst" >&2 || true
  exit 1
fi

mkdir -p "$dst"
# Remove CRDs that no longer exist upstream, then copy the current ones.
for f in "$dst"/*.yaml; do
  [[ -e "$f" ]] || continue
  [[ -e "$src/$(basename "$f")" ]] || rm -f "$f"
done
cp "$src"/*.yaml "$dst"/
echo "copied $(ls "$src"/*.yaml | wc -l) CRDs into ${dst#"$repo"/}"
