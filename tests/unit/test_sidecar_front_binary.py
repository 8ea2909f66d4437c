"""Where the sidecar finds ``slipstream-front``: the flag, beside its Python, on PATH."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from slipstream_sidecar.front import BINARY, FrontMissingError, find_binary

pytestmark = pytest.mark.unit


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def python_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``bin`` folder this process's Python seems to run from, and an empty PATH."""
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return bindir


def test_the_flag_wins_and_must_be_an_executable_file(python_in: Path, tmp_path: Path) -> None:
    _executable(python_in / BINARY)
    given = _executable(tmp_path / "elsewhere" / BINARY)
    assert find_binary(given) == given
    for bad in (tmp_path / "missing", tmp_path):  # absent; a directory
        with pytest.raises(FrontMissingError, match="make front"):
            find_binary(bad)


def test_beside_the_python_first_then_on_path(
    python_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path = _executable(tmp_path / "path" / BINARY)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_binary(None) == on_path
    beside = _executable(python_in / BINARY)
    assert find_binary(None) == beside


def test_nowhere_is_one_line_naming_how_to_build_it(python_in: Path) -> None:
    with pytest.raises(FrontMissingError) as info:
        find_binary(None)
    message = str(info.value)
    assert "\n" not in message
    assert "make front" in message and "--front-binary" in message and str(python_in) in message
