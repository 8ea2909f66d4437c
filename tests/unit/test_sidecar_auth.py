"""The control API's bearer token check."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slipstream_sidecar.auth import TokenFile
from slipstream_sidecar.errors import AuthError

pytestmark = pytest.mark.unit


def test_token_must_match_exactly(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    tokens = TokenFile(path)
    assert tokens.check("Bearer s3cret")
    assert not tokens.check("Bearer s3cre")
    assert not tokens.check("s3cret")
    assert not tokens.check(None)


def test_rotated_secret_takes_effect(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("old")
    tokens = TokenFile(path)
    path.write_text("new")
    st = path.stat()
    os.utime(path, (st.st_atime, st.st_mtime + 5))
    assert tokens.check("Bearer new") and not tokens.check("Bearer old")


def test_without_a_token_file_everything_is_refused(tmp_path: Path) -> None:
    assert not TokenFile(None).check("Bearer anything")
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(AuthError):
        TokenFile(empty)
