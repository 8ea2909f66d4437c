"""The committed gRPC code must be what hack/gen-proto.sh makes from sidecar.proto."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "sidecar" / "slipstream_sidecar" / "proto"
GENERATED = ("sidecar_pb2.py", "sidecar_pb2_grpc.py", "sidecar_pb2.pyi", "sidecar_pb2_grpc.pyi")


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    subprocess.run(
        ["bash", str(ROOT / "hack" / "gen-proto.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
    )
    for name in GENERATED:
        fresh = (tmp_path / "slipstream_sidecar" / "proto" / name).read_text()
        committed = (PROTO_DIR / name).read_text()
        assert fresh == committed, f"{name} is stale: run hack/gen-proto.sh"


def test_generated_module_imports_under_package_path() -> None:
    from slipstream_sidecar.proto import sidecar_pb2, sidecar_pb2_grpc

    assert sidecar_pb2.DESCRIPTOR.package == "slipstream.sidecar.v1alpha1"
    assert hasattr(sidecar_pb2_grpc, "SidecarServicer")
