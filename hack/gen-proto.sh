#!/usr/bin/env bash
# Generate the sidecar's gRPC code from sidecar/slipstream_sidecar/proto/sidecar.proto.
#
# Writes sidecar_pb2.py, sidecar_pb2_grpc.py and their .pyi stubs (mypy-protobuf) beside the
# .proto. The proto is compiled with `sidecar/` as the include root, so the generated modules
# import each other as `slipstream_sidecar.proto.*` and `from slipstream_sidecar.proto import
# sidecar_pb2` works. Usage: hack/gen-proto.sh [OUT_DIR] (default: the source tree; the drift
# test passes a temporary directory). PYTHON selects the interpreter (default: the repo venv).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/sidecar}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
BIN=$(dirname "$PYTHON")
mkdir -p "$OUT"
cd "$ROOT/sidecar"
PATH="$BIN:$PATH" "$PYTHON" -m grpc_tools.protoc \
  --proto_path=. \
  --python_out="$OUT" \
  --grpc_python_out="$OUT" \
  --mypy_out="$OUT" \
  --mypy_grpc_out="$OUT" \
  slipstream_sidecar/proto/sidecar.proto
