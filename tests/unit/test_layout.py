"""The repository layout must never shadow the standard library."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


def test_import_operator_is_stdlib() -> None:
    op = importlib.import_module("operator")
    assert op.__file__ is not None
    assert "site-packages" not in op.__file__
    assert hasattr(op, "itemgetter")


def test_stdlib_operator_in_fresh_interpreter_from_repo_root(repo_root: object) -> None:
    # Run from the repo root, where a top-level ``operator/`` folder exists.
    code = "import operator, dataclasses; print(operator.itemgetter.__module__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=str(repo_root), capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "operator"


def test_packages_import() -> None:
    for name in ("slipstream_scheduler", "slipstream_cli"):
        assert importlib.import_module(name).__doc__
