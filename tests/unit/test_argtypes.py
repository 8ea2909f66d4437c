"""The CLI's value converters: a bad value is a usage error that names it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from slipstream_cli.argtypes import nonnegative, positive, share, whole
from slipstream_cli.main import main

Convert = Callable[[str], float]


@pytest.mark.parametrize(("convert", "text", "want"), [
    (nonnegative, "0", 0.0), (nonnegative, "60", 60.0), (positive, "0.5", 0.5),
    (share, "1", 1.0), (whole(1), "3", 3),
])
def test_good_values_convert(convert: Convert, text: str, want: float) -> None:
    assert convert(text) == want


@pytest.mark.parametrize(("convert", "text", "says"), [
    (nonnegative, "-1", "at least 0"), (nonnegative, "inf", "at least 0"),
    (nonnegative, "nan", "at least 0"), (nonnegative, "soon", "not a number"),
    (positive, "0", "positive"), (share, "1.5", "(0, 1]"), (whole(1), "0", "at least 1"),
    (whole(1), "2.5", "not a whole number"),
])
def test_bad_values_are_usage_errors(convert: Convert, text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(says)):
        convert(text)


def test_a_bad_settle_time_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "core", "--load-settle-s", "-5"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--load-settle-s" in err and "at least 0" in err and "Traceback" not in err


def test_missing_data_is_an_error_naming_the_file_not_a_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLIPSTREAM_DATA", str(tmp_path))
    assert main(["sim", "--duration-s", "10"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slipstream sim: error: ")
    assert str(tmp_path / "azure_llm_2023") in err and "SLIPSTREAM_DATA" in err
    assert "Traceback" not in err


def test_a_missing_alpacaeval_file_is_an_error_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SLIPSTREAM_DATA", str(tmp_path))
    assert main(["bench", "ordering", "--requests", "10", "--json", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert "data file not found" in err and str(tmp_path / "prompts") in err
    assert "Traceback" not in err


def test_a_soak_too_short_for_one_fault_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "soak", "--duration", "60", "--every", "120"]) == 2
    err = capsys.readouterr().err
    assert "--duration 60" in err and "--every" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "soak", "--mode", "kernel"])
    assert exc.value.code == 2
    assert "invalid choice: 'kernel'" in capsys.readouterr().err
